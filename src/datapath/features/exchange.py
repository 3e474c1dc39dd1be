"""The exchange of a sharded `FeatureStore`: `ShardedTier` fetches the rows other ranks hold from them.

`datapath.features.sharded.sharded_store` builds the store: each rank keeps its shard in pinned
host memory (read zero copy by its GPU) and serves the other ranks' requests from it (through its
GPU cache where it holds the row).  The other ranks' rows come through `ShardedTier`, a
collective `FetchTier`: every gather of every rank enters its exchange, in the same order, also
with no remote rows (a `datapath.loaders.DistributedNeighborLoader` makes every rank take the same
steps, on one producer thread).  One exchange:

1. the batch's ids are sorted by owner on the device (the rows the store's other tiers serve, and
   bad ids, sort last): how many rows this rank asks of each rank, without a host synchronisation;
2. all_gather of those counts (a W x W matrix every rank sees; a rank that cannot fetch sends -1,
   and every rank raises an error naming it): the exchange's one host synchronisation;
3. all_to_all of the requested row numbers (in each owner's own numbering);
4. every owner gathers the requested rows from its tiers (its GPU cache, else zero copy from its
   pinned shard, straight into a device buffer);
5. all_to_all of the rows back, in pieces of about `PIECE_BYTES` per rank (up to `MAX_PIECES`):
   the owner gathers piece k + 1 while piece k is sent, and each piece received is scattered
   straight into the batch's rows.

Steps 3-5 are skipped when no rank asks for anything; such an exchange still records its stages (the counts
stage, the ids and rows stages at zero), so that each stage's seconds over ``timed_exchanges`` in the tier's
statistics is its mean over every batch.  The exchange runs on a process group of
its own (NCCL between GPUs, gloo between CPUs), on the loader's exchange thread, while the
training thread runs DDP's all-reduce on the default group.  The two threads take turns
(`datapath.loaders.CollectiveOrder`), at the same places of the schedule on every rank, as NCCL
asks of two communicators (submitted in the same order on every rank, never at once).  The
loader submits each exchange's collectives in two turns (`ShardedTier.prepare_fetch_slots`): step
2's all_gather in one, not waited for (the counts copied to pinned memory behind it), steps 3-5 in
the next, and does what needs no collective between the turns, while the training thread runs a
step: step 1's sort before the first, the counts' read (`SplitExchange.read`, the host
synchronisation) and step 3's row numbers, buffers and split sizes before the second.  A turn holds
the collectives and what follows them in stream order (the owner's gather, the scatter).  Only the
features are sharded: every rank holds the whole graph and samples from it without communication.
The steps of one exchange are in `datapath.features.exchange_steps`.
"""
from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from datapath.features.errors import FeatureStoreError, ShardExchangeError
from datapath.features.exchange_steps import MAX_PIECES, ExchangeSteps, _Counts, _Record
from datapath.features.tiers import FetchTier
from datapath.graph import ShardLayout
from datapath.memory import ErrorFlag

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_PIECES", "PIECE_BYTES", "ShardedTier", "SplitExchange", "new_exchange_group"]

DEFAULT_TIMEOUT_S = 600.0
"""How long a rank waits in an exchange for the others before it fails (seconds)."""

PIECE_BYTES = 32 << 20
"""Rows go to a rank in pieces of about this many bytes: the owner gathers a piece while the previous one is sent."""



class ShardedTier(ExchangeSteps, FetchTier):
    """The rows other ranks hold: fetched from their owners by an exchange on ``group`` (see the module docstring).

    Args:
        shard: (n, *rest) this rank's rows ``layout.rows(rank)``: pinned host memory for a CUDA
            ``device`` (served zero copy), CPU memory otherwise.
        layout: how the table's rows are cut into the ranks' shards.
        rank: this process's rank in ``group``.
        group: the process group of the exchange (all ``layout.shards`` ranks).
        device: where fetched rows go.
        piece_bytes: the rows for one rank go in pieces of about this many bytes (at most `MAX_PIECES`),
            so that the owner gathers a piece from its tiers while the previous one is sent.
    """

    name = "remote"
    collective = True

    def __init__(self, shard: torch.Tensor, layout: ShardLayout, rank: int, group: Any,
                 device: torch.device, piece_bytes: int = PIECE_BYTES) -> None:
        super().__init__()
        if piece_bytes < 1:
            raise FeatureStoreError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.piece_bytes = int(piece_bytes)
        self.shard = shard
        self.layout = layout
        self.rank = int(rank)
        self.world_size = layout.shards
        self.group = group
        self.device = torch.device(device)
        self.backend = str(dist.get_backend(group))
        # where the tensors of the collectives live: NCCL moves GPU memory, gloo host memory
        self._comm = self.device if self.backend == "nccl" else torch.device("cpu")
        self._bounds = torch.tensor(layout.bounds, dtype=torch.int64, device=self.device)
        self._id_dtype = torch.int32 if max(layout.size(r) for r in range(layout.shards)) < 2**31 else torch.int64
        self._rest = tuple(shard.shape[1:])
        self._row_bytes = math.prod(self._rest) * shard.element_size()
        self._lock = threading.Lock()
        self._flag = ErrorFlag() if self.device.type == "cuda" else None
        # each finished exchange's statistics (`_Record`): the exchange thread appends, `stats` (any thread) folds
        self._records: list[_Record] = []
        self._records_lock = threading.Lock()
        self._joined = False  # this exchange has entered its first collective
        self._broken: str | None = None
        lo, hi = layout.rows(self.rank)
        self._lo = lo
        self.rows = layout.num_rows - (hi - lo)
        self._cache: torch.Tensor | None = None  # the store's GPU cache and slot map (`attach`)
        self._slots: torch.Tensor | None = None
        self._remote_slot: torch.Tensor | None = None  # (c + 1,) bool: cache slot s holds another shard's row
        # per stage (GPU time on CUDA, host time otherwise): counts = ids sorted by owner + the counts all_gather
        # (the one host synchronisation), ids = their all_to_all, exchange = owner's gather + rows all_to_all +
        # scatter into the batch.  Every exchange records every stage (ids and exchange zero where no rank asks for
        # a row), so ``<stage>_seconds / timed_exchanges`` is a stage's mean over all batches; timed_exchanges:
        # the exchanges whose times (and cache counters) are folded in, on CUDA once their GPU work is done
        # (``exchanges`` counts them when their counts are read).  wall = host time of the whole call: submit (its
        # collectives and what follows them, what a loader's turns take) + prepare (what precedes them and needs
        # no collective: the sort, the buffers, the split sizes; between the turns) + counts_wait (the host's wait
        # for the counts); submit_cpu: the exchange thread's CPU time in submit (the rest of submit: waiting, for
        # the GIL or in a call that blocks); sent_from_cache_rows: rows this rank served the others from its GPU
        # cache; remote_cache_rows: rows of other shards this rank's batches found in its own GPU cache (not fetched)
        self._stats.extra.update(exchanges=0, timed_exchanges=0, received_rows=0, received_bytes=0, sent_rows=0,
                                 sent_bytes=0, sent_from_cache_rows=0, remote_cache_rows=0, id_bytes=0,
                                 counts_seconds=0.0, ids_seconds=0.0, exchange_seconds=0.0, wall_seconds=0.0,
                                 submit_seconds=0.0, counts_wait_seconds=0.0, prepare_seconds=0.0,
                                 submit_cpu_seconds=0.0)

    def attach(self, cache: torch.Tensor | None, slots: torch.Tensor) -> None:
        """Serve the other ranks' requests through the store's tiers: rows in ``cache`` (its GPU cache) from there.

        ``slots``: the store's (N,) int32 slot map (``1..c`` cache rows, ``c+1..`` this rank's shard).
        """
        if self._comm == self.device:  # the rows are served where the collective sends them from
            self._cache, self._slots = cache, slots[self._lo:self._lo + self.shard.shape[0]]  # this shard's slots
            if cache is None:  # the tiered gather's first tier, empty
                self._cache = torch.empty((0, *self._rest), dtype=self.shard.dtype, device=self._comm)

    def mark_remote_cache(self, remote: torch.Tensor) -> None:
        """``remote``: (c,) bool, whether cache slot ``s + 1`` holds a row of another shard (counted as
        ``remote_cache_rows`` when a batch finds it there)."""
        self._remote_slot = torch.cat([torch.zeros(1, dtype=torch.bool), remote.cpu().bool()]).to(self.device)

    # `FeatureStore.stats` reads ``tier.stats``: the finished exchanges' times and cache counters are folded in first
    @property
    def stats(self) -> Any:
        self._fold()
        return self._stats

    @stats.setter
    def stats(self, value: Any) -> None:
        self._stats = value

    def fetch(self, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """``out[positions] = rows ids`` fetched from their owners (collective: every rank calls it, see `exchange`)."""
        rows = self.exchange(ids)
        if ids.numel():
            out.index_copy_(0, positions.to(out.device), rows.to(out.device))

    reads_slots = True

    def fetch_slots(self, ids: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, flag: Any = None) -> None:
        """``out[k] = row ids[k]`` for every ``k`` with ``loc[k] < 0`` (the rows of other ranks the store lacks).

        The store's gather calls this instead of `fetch`: the rows are picked on the device (no
        host synchronisation but the exchange's one), and each piece of received rows is scattered
        straight into ``out``.  Collective, as `exchange`.
        """
        with self._lock:
            self._guarded(lambda: self._whole(self._prepare_slots(ids, loc, out, flag)))

    def prepare_fetch_slots(self, ids: torch.Tensor, loc: torch.Tensor, out: torch.Tensor,
                            flag: Any = None) -> "SplitExchange":
        """`fetch_slots` in parts, each on the then current stream.  This one submits no collective: it sorts the
        ids by owner and makes the counts' buffers.  `SplitExchange.submit` submits the counts all_gather (not
        waited for); `SplitExchange.read` waits for the counts (the one host synchronisation) and prepares the
        rest (the row numbers asked of each owner, the receive buffers, the split sizes); `SplitExchange.finish`
        submits the ids and rows all_to_alls, the owner's gather and the scatter into ``out``.

        A loader submits and finishes in two turns of its `datapath.loaders.CollectiveOrder`, and prepares and
        reads between them.  Every rank calls the parts in the same order as its other exchanges (collective, as
        `exchange`).  An error here is raised without telling the other ranks (that takes a collective): the
        caller takes the exchange's place with `abort`; an error of a later part is raised as by `fetch_slots`.
        """
        with self._lock:
            if self._broken is not None:
                raise ShardExchangeError(self._broken)
            return SplitExchange(self, self._prepare_slots(ids, loc, out, flag))

    def exchange(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ((k,) int64 rows of the whole table, any device; repeats allowed) as (k, *rest) on ``device``.

        Collective: every rank of the group calls it the same number of times (with an empty ``ids``
        when it needs nothing); each call is self-contained, so threads of a rank may take turns.

        Raises:
            IndexError: an id of this rank lies outside the table (the other ranks raise
                `ShardExchangeError` naming this rank).
            ShardExchangeError: another rank's request failed, or the exchange itself failed (a rank
                died or stopped answering within the group's timeout); the message names the rank.
        """
        with self._lock:  # one exchange at a time: threads of one rank take turns (each call is self-contained)
            return self._guarded(lambda: self._exchange(ids.reshape(-1)))

    def _guarded(self, run: Any, joined: bool = False) -> Any:
        """``run()``, one exchange (or a part of it after its first collective: ``joined``); a failure before its
        first collective tells the others, one in it breaks it."""
        if self._broken is not None:
            raise ShardExchangeError(self._broken)
        self._joined = joined
        try:
            return run()
        except (IndexError, ShardExchangeError):
            raise
        except Exception as exc:
            if not self._joined:  # failed before the first collective: the others learn it from the -1 there
                self._signal_failure()
                raise
            # a collective failed: the group is unusable now
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._broken = (f"rank {self.rank} of {self.world_size}: the exchange of feature rows failed "
                            f"({type(exc).__name__}: {cause}); another rank has died or stopped answering: "
                            f"see its own error")
            raise ShardExchangeError(self._broken) from exc

    def abort(self, error: BaseException) -> None:
        """Tell the other ranks, in place of this gather's exchange, that this rank's gather failed (the
        exchanges still pair up afterwards: this call took the failed one's turn)."""
        with self._lock:
            if self._broken is None:
                self._signal_failure()

    # -- one exchange ------------------------------------------------------------------------
    def _exchange(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ((k,) of the whole table): one exchange; an id outside the table on any rank fails every
        rank's (this rank raises ``IndexError``, the others `ShardExchangeError` naming it)."""
        ids = ids.to(self.device, torch.int64)
        dest = torch.empty((ids.numel(), *self._rest), dtype=self.shard.dtype, device=self.device)
        self._whole(self._prepare(ids, None, dest, None))
        return dest

    def _prepare_slots(self, ids: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, flag: Any) -> "_Counts":
        n = self.layout.num_rows
        ids = ids.to(self.device).long()
        ids = torch.where(ids < 0, ids + n, ids)
        loc = loc.to(self.device)
        if self._remote_slot is not None and ids.numel():  # rows of other shards this rank's cache served
            c = self._remote_slot.numel() - 1  # slots 1..c: the cache; c + 1..: this rank's shard
            hit = self._remote_slot[torch.where((loc > 0) & (loc <= c), loc, 0).long()].sum()
        else:
            hit = None
        counts = self._prepare(ids, loc < 0, out, flag)
        counts.hits = hit  # this exchange's own counter: published with its statistics (`_rows`)
        return counts

    def _whole(self, c: "_Counts") -> None:
        """Every part of one prepared exchange at once (`fetch_slots`, `exchange`)."""
        self._submit(c)
        self._read(c)
        self._rows(c)

    def _fold(self) -> None:
        """Add the statistics of the finished exchanges to the tier's: their stage times and cache counters.

        Each exchange counts its rows served from the cache and its rows of other shards found in the cache in
        counters of its own, which the exchange thread publishes with its stage times (`_Record`) once it has
        written them (on CUDA: a copy to pinned memory behind the exchange's work, done when its event is), and
        nothing writes them afterwards.  So this read cannot tear: no counter is read while another thread (or a
        stream) adds to it, no count is zeroed after it was read, and every exchange is folded exactly once (the
        records taken from the list under its lock), all of its statistics together, under the lock `TierStats.snapshot`
        reads and zeroes under (as every statistic the exchange thread adds: `TierStats.add`).
        """
        with self._records_lock:
            ready = []
            keep = []
            for rec in self._records:
                (ready if rec.done is None or rec.done.query() else keep).append(rec)
            self._records = keep
            for rec in ready:
                stages, (from_cache, remote_hits) = rec.resolve()
                # one update under the statistics' lock (the one a reset takes): the exchange falls wholly before
                # or after a reset; the time between the two parts is not the exchange's
                self._stats.add(seconds=sum(stages), counts_seconds=stages[0], ids_seconds=stages[1],
                                exchange_seconds=stages[2], sent_from_cache_rows=from_cache,
                                remote_cache_rows=remote_hits, timed_exchanges=1)

    def close(self) -> None:
        """Mark the tier closed: a later fetch raises, naming this rank (the shard's memory goes with the tier
        object; the process group belongs to the job and is left alone)."""
        self._broken = self._broken or f"rank {self.rank}: this sharded feature store was closed"


class SplitExchange:
    """An exchange in parts (`ShardedTier.prepare_fetch_slots`), its counts prepared: `submit`, `read`, then
    `finish`, each once, in that order (each runs the ones before it not yet run)."""

    def __init__(self, tier: ShardedTier, counts: _Counts) -> None:
        self._tier, self._c = tier, counts

    def submit(self) -> None:
        """Submit the counts all_gather on the current stream (collective), not waiting for it."""
        if self._c.submitted:
            return
        t = self._tier
        with t._lock:  # noqa: SLF001 - the tier's own parts
            t._guarded(lambda: t._submit(self._c))  # noqa: SLF001

    def read(self) -> None:
        """Wait for the counts (host synchronisation; raise as `ShardedTier.fetch_slots` when a rank failed), then
        prepare what `finish` submits (on the current stream; no collective)."""
        if self._c.planned:
            return
        self.submit()
        t = self._tier
        with t._lock:  # noqa: SLF001
            t._guarded(lambda: t._read(self._c), joined=True)  # noqa: SLF001

    def finish(self) -> None:
        """Submit the ids and rows all_to_alls, the owner's gather and the scatter (on the current stream)."""
        self.read()
        t = self._tier
        with t._lock:  # noqa: SLF001
            t._guarded(lambda: t._rows(self._c), joined=True)  # noqa: SLF001


def new_exchange_group(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> Any:
    """A process group of all ranks for the exchange (collective: every rank calls it): NCCL on GPUs, gloo on CPUs."""
    if backend is None:
        backend = "nccl" if dist.get_backend() == "nccl" else "gloo"
    options = None
    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        # its kernels on a high-priority stream: an exchange is short and the step waits for it, while the
        # sampling and gather kernels beside it fill the GPU for milliseconds
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    return dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s), pg_options=options)
