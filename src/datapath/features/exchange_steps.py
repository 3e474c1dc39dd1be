"""The steps of one exchange of a `ShardedTier` (`datapath.features.exchange`).

`ExchangeSteps` holds them (the numbered steps of `datapath.features.exchange`'s docstring): `_prepare`
(step 1: the ids sorted by owner, the counts' buffers), `_submit` (step 2: the counts all_gather, or
`_signal_failure`'s -1s in its place), `_read` (the exchange's one host synchronisation; `_raise_failed`)
and `_plan` (the row numbers of step 3, the receive buffers, the pieces' split sizes: `_pieces`,
`_plan_pieces`), `_rows` (steps 3-5: the ids all_to_all, then per piece the owner's gather `_serve`, the
rows' all_to_all and the scatter: `_send_rows`).  `_Counts` carries one exchange from part to part
(`datapath.features.exchange.SplitExchange` runs the parts in a loader's turns).
"""
from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from datapath._runtime.pinned import pinned_empty
from datapath.features.errors import ShardExchangeError
from datapath.memory import gather_rows, gather_tiered

log = logging.getLogger("datapath.features.exchange")  # one logger for the tier and its steps

MAX_PIECES = 4

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ExchangeSteps:
    """The steps of one exchange, mixed into `ShardedTier`: they read and update the tier's state, set by its
    ``__init__`` (``shard``, ``layout``, ``rank``, ``world_size``, ``group``, ``device``, ``piece_bytes``, and
    ``_comm``, ``_bounds``, ``_id_dtype``, ``_rest``, ``_row_bytes``, ``_flag``, ``_cache``, ``_slots``,
    ``_records``, ``_records_lock``, ``_joined``, ``_stats``)."""

    def _signal_failure(self) -> None:
        """Enter this exchange's first collective with -1s: every other rank raises, naming this one."""
        try:
            out = torch.empty(self.world_size * self.world_size, dtype=torch.int64, device=self._comm)
            _all_gather(out, torch.full((self.world_size,), -1, dtype=torch.int64, device=self._comm), group=self.group)
            out.tolist()  # every rank has entered it
        except Exception:  # noqa: BLE001 - the original error is what the caller raises
            log.debug("rank %d could not tell the other ranks that it failed", self.rank, exc_info=True)

    def _prepare(self, ids: torch.Tensor, want: torch.Tensor | None, dest: torch.Tensor, flag: Any) -> "_Counts":
        """What the exchange's first collective needs, no collective submitted: the ids sorted by owner, the rows
        this rank asks of each rank, the all_gather's buffers (on the current stream, no host synchronisation
        but where the group is gloo and ``device`` CUDA: the counts copied to host memory)."""
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        if self._flag is not None:
            self._flag.raise_if_set(f" (rows a rank asked of rank {self.rank}'s shard: an internal error)")
        start = _event() if cuda else None
        n = self.layout.num_rows
        inside = (ids >= 0) & (ids < n)
        # sorted, so grouped by owner; rows not wanted (and bad ids) sort last, past every shard; repeats are asked
        # for as often as they come (a loader's ids are distinct, and sorting needs no host synchronisation)
        keep = inside if want is None else inside & want
        ordered, perm = torch.sort(torch.where(keep, ids, n))
        cuts = torch.searchsorted(ordered, self._bounds)
        asks = cuts[1:] - cuts[:-1]
        asks = torch.where((~inside).any(), torch.full_like(asks, -1), asks)  # a bad id: every rank stops
        c = _Counts(ids, ordered, perm, asks, dest, flag)
        c.send = asks.to(self._comm)
        c.out = torch.empty(self.world_size * self.world_size, dtype=torch.int64, device=self._comm)
        if self._comm.type == "cuda":  # where the counts are copied behind the all_gather
            c.host = pinned_empty((c.out.numel(),), torch.int64)
        if cuda:
            c.events = [start, _event()]
        c.prep_counts_s = time.perf_counter() - t0
        self._stats.add(prepare_seconds=c.prep_counts_s)  # under the statistics' lock, as every update below
        return c

    def _submit(self, c: "_Counts") -> None:
        """The exchange's first collective: the counts all_gather, submitted, not waited for (on CUDA its values
        copied to pinned memory behind it, on the current stream)."""
        cuda = self.device.type == "cuda"
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if cuda:
            c.events.append(_event())
        self._joined = True
        if self._comm.type == "cuda":
            _all_gather(c.out, c.send, group=self.group)
            c.host.copy_(c.out, non_blocking=True)
            c.ready = torch.cuda.Event(blocking=True)
            c.ready.record()
        else:  # gloo runs it on its own thread: waited for in `_read`
            c.work = _all_gather(c.out, c.send, group=self.group, async_op=True)
        if cuda:
            c.events.append(_event())
        c.submitted = True
        c.host_s, c.cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0

    def _read(self, c: "_Counts") -> None:
        """The exchange's one host synchronisation: wait for the counts matrix and raise if a rank failed; then
        prepare the second part (`_plan`)."""
        t0 = time.perf_counter()
        c.matrix = _host_counts(c)
        c.wait_s = time.perf_counter() - t0
        self._stats.add(counts_wait_seconds=c.wait_s)
        self._raise_failed(c.matrix, c.ids, c.flag)
        self._plan(c)

    def _plan(self, c: "_Counts") -> None:
        """What the second part's collectives need, none submitted (the counts read): the row numbers this rank
        asks of each owner (in the owner's numbering), the receive buffers, every piece's split sizes and where
        its rows go (on the current stream); and the part's statistics."""
        t0 = time.perf_counter()
        matrix = c.matrix
        mine = matrix[self.rank]  # rows this rank asks of each rank
        theirs = [matrix[r][self.rank] for r in range(self.world_size)]  # rows each rank asks of this one
        c.total = total = sum(mine)
        counted = {"exchanges": 1}
        if any(any(row) for row in matrix):
            local = c.ordered[:total] - torch.repeat_interleave(self._bounds[:-1], c.asks, output_size=total)
            c.local = local.to(self._comm, self._id_dtype)
            c.wanted = torch.empty(sum(theirs), dtype=self._id_dtype, device=self._comm)
            c.splits = (mine, theirs)
            c.pieces = self._plan_pieces(mine, theirs, self._pieces(matrix), c.perm[:total], c.dest.device)
            if self._slots is not None:  # rows this exchange serves from the cache / host (`gather_tiered`)
                c.served = torch.zeros(3, dtype=torch.int64, device=self._comm)
            remote_in = total - mine[self.rank]
            remote_out = sum(theirs) - theirs[self.rank]
            counted.update(received_rows=remote_in, received_bytes=remote_in * self._row_bytes,
                           sent_rows=remote_out, sent_bytes=remote_out * self._row_bytes,
                           id_bytes=(remote_in + remote_out) * c.wanted.element_size())
        c.planned = True
        c.prep_rest_s = time.perf_counter() - t0
        # the part's statistics in one update, under the lock a reset takes (never read, added to and written
        # back around a reset on another thread)
        self._stats.add(rows=total, nbytes=total * self._row_bytes, prepare_seconds=c.prep_rest_s, **counted)

    def _rows(self, c: "_Counts") -> None:
        """The exchange's second part (`_plan` done): the ids all_to_all, then per piece the owner's gather of the
        rows asked of it, their all_to_all and the scatter into ``c.dest`` (each behind the one before it)."""
        cuda = self.device.type == "cuda"
        t1, cpu1 = time.perf_counter(), time.thread_time()
        resumed = _event() if cuda else None
        # host time of the first part (CPU: the counts stage): its preparation, submission and wait
        counts_s = c.prep_counts_s + c.host_s + c.wait_s
        if c.pieces:
            mine, theirs = c.splits
            dist.all_to_all_single(c.wanted, c.local, theirs, mine, group=self.group)
            mid = _event() if cuda else None
            t_mid = time.perf_counter()
            self._send_rows(c.wanted, c.pieces, c.dest, c.served)
            stages = (*c.events, resumed, mid, _event()) if cuda else \
                (counts_s, c.prep_rest_s + t_mid - t1, time.perf_counter() - t_mid)
        else:  # no rank asks for a row: the counts stage alone (the ids and rows stages take no time)
            stages = (*c.events, resumed, resumed, resumed) if cuda else (counts_s, 0.0, 0.0)
        self._publish(c, stages)
        submit = c.host_s + time.perf_counter() - t1
        self._stats.add(submit_seconds=submit, submit_cpu_seconds=c.cpu_s + time.thread_time() - cpu1,
                        wall_seconds=submit + c.prep_counts_s + c.prep_rest_s + c.wait_s)

    def _publish(self, c: "_Counts", stages: tuple[Any, ...]) -> None:
        """Hand exchange ``c``'s statistics to `ShardedTier._fold`: its stage times and its own cache counters
        (rows served from the cache, rows of other shards found in it), as ints on a CPU, on CUDA copied to pinned
        memory behind the exchange's work on the current stream (folded once that copy is done)."""
        served, hits = c.served, c.hits
        if self.device.type == "cuda":
            counters = None
            if served is not None or hits is not None:
                zero = torch.zeros(1, dtype=torch.int64, device=self.device)
                both = torch.cat([zero if served is None else served[:1].to(self.device),
                                  zero if hits is None else hits.reshape(1)])
                counters = pinned_empty((2,), torch.int64)
                counters.copy_(both, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            rec = _Record(stages, counters, done)
        else:
            rec = _Record(stages, (0 if served is None else int(served[0]), 0 if hits is None else int(hits)), None)
        with self._records_lock:
            self._records.append(rec)

    def _pieces(self, matrix: list[list[int]]) -> int:
        """Pieces the rows go in (the same on every rank: from the matrix all of them see)."""
        largest = max(max(row) for row in matrix) * self._row_bytes
        return max(1, min(MAX_PIECES, -(-largest // self.piece_bytes)))

    def _plan_pieces(self, mine: list[int], theirs: list[int], pieces: int, at: torch.Tensor,
                     device: torch.device) -> list["_Piece"]:
        """The rows' all_to_alls: piece ``c`` carries rows ``n*c//pieces .. n*(c+1)//pieces`` of every segment of
        ``n`` rows (of ``theirs`` sent, of ``mine`` received); its received rows go to ``dest[at[...]]``.

        ``at``: (sum(mine),) int64, where the ``i``-th row this rank asked for goes.
        """
        w = self.world_size
        t_at = [sum(theirs[:j]) for j in range(w)]
        m_at = [sum(mine[:j]) for j in range(w)]
        out = []
        for c in range(pieces):
            send = [(theirs[j] * c // pieces, theirs[j] * (c + 1) // pieces) for j in range(w)]
            recv = [(mine[j] * c // pieces, mine[j] * (c + 1) // pieces) for j in range(w)]
            if pieces == 1:
                sel, where = None, at
            else:
                sel = torch.cat([torch.arange(t_at[j] + a, t_at[j] + b, device=self._comm)
                                 for j, (a, b) in enumerate(send)])
                where = torch.cat([at[m_at[j] + a:m_at[j] + b] for j, (a, b) in enumerate(recv)])
            sizes = [b - a for a, b in recv], [b - a for a, b in send]
            got = torch.empty((sum(sizes[0]), *self._rest), dtype=self.shard.dtype, device=self._comm)
            # the rows served go here (the store's tiered gather; the other gathers make their own)
            serve = (torch.empty((sum(sizes[1]), *self._rest), dtype=self.shard.dtype, device=self._comm)
                     if self._slots is not None else None)
            out.append(_Piece(got, *sizes, sel, where.to(device), serve))
        return out

    def _send_rows(self, wanted: torch.Tensor, pieces: list["_Piece"], dest: torch.Tensor,
                   served: torch.Tensor | None = None) -> None:
        """Serve ``wanted``, exchange the rows in ``pieces`` and scatter them into ``dest`` (rows served from the
        cache / host counted in ``served``).

        Piece ``c + 1``'s rows are gathered while piece ``c`` is sent, and each piece received is scattered
        into ``dest`` (no staging buffer for the whole batch).
        """
        def put(p: _Piece) -> None:
            if p.where.numel():
                dest.index_copy_(0, p.where, p.got.to(dest.device))

        if len(pieces) == 1:
            p = pieces[0]
            dist.all_to_all_single(p.got, self._serve(wanted, p.out, served), p.recv, p.send, group=self.group)
            put(p)
            return
        sent = []
        for p in pieces:
            work = dist.all_to_all_single(p.got, self._serve(wanted.index_select(0, p.sel), p.out, served), p.recv,
                                          p.send, group=self.group, async_op=True)
            sent.append((work, p))
        for work, p in sent:
            work.wait()
            put(p)

    def _raise_failed(self, matrix: list[list[int]], ids: torch.Tensor, flag: Any = None) -> None:
        failed = [r for r, row in enumerate(matrix) if any(v < 0 for v in row)]
        if not failed:
            return
        if self.rank in failed:
            if flag is not None:  # the store's lookup saw the bad index first: its message names it as given
                flag.raise_if_set()
            n = self.layout.num_rows
            bad = torch.unique(ids[(ids < 0) | (ids >= n)])
            raise IndexError(f"rank {self.rank}: row ids {bad[:5].tolist()}{' ...' if bad.numel() > 5 else ''} are "
                             f"out of bounds for a sharded table of {n} rows")
        raise ShardExchangeError(f"rank {self.rank} of {self.world_size} stops: rank {failed[0]} could not fetch its "
                                 f"feature rows (see its own error)")

    def _serve(self, wanted: torch.Tensor, out: torch.Tensor | None = None,
               served: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of this rank's shard that the others asked for, where the collective needs them (the rows
        served from the cache / host counted in ``served``, (3,) int64, when attached).

        Through the store's tiers when attached (one tiered gather: cached rows from the GPU cache,
        the others zero copy from pinned host memory; into ``out`` if given), else from the shard.
        """
        if self._slots is not None:
            loc = self._slots.index_select(0, wanted)
            if out is None:
                out = torch.empty((wanted.numel(), *self._rest), dtype=self.shard.dtype, device=self._comm)
            return gather_tiered(self._cache, self.shard, loc, out, error_flag=self._flag, counts=served)
        if self._comm.type == "cuda":  # zero copy from pinned host memory onto the GPU
            return gather_rows(self.shard, wanted, self._flag)
        return self.shard.index_select(0, wanted.long())


class _Counts:
    """One exchange between its parts: what each part leaves for the next (`ShardedTier._prepare`)."""

    def __init__(self, ids: torch.Tensor, ordered: torch.Tensor, perm: torch.Tensor, asks: torch.Tensor,
                 dest: torch.Tensor, flag: Any) -> None:
        self.ids, self.ordered, self.perm, self.asks, self.dest, self.flag = ids, ordered, perm, asks, dest, flag
        # ``send``: (W,) int64 ``asks`` where the all_gather sends from, ``out``: (W * W,) its output, ``host``: its
        # pinned copy (CUDA), complete at ``ready``; ``work``: gloo's pending all_gather
        self.send = self.out = self.host = self.ready = self.work = None
        self.events: list[Any] = []  # CUDA: start, sorted (the preparation), submitted, counted (the all_gather)
        self.submitted = self.planned = False
        self.matrix: list[list[int]] | None = None
        # the second part, planned once the counts are read (`ShardedTier._plan`): ``local``: (total,) the row
        # numbers this rank asks, in their owners' numbering; ``wanted``: (sum(theirs),) those asked of it
        self.total = 0
        self.local = self.wanted = None
        self.splits: tuple[list[int], list[int]] | None = None  # rows this rank asks of each rank, each asks of it
        self.pieces: list[_Piece] = []  # the rows' all_to_alls (none when no rank asks for anything)
        # this exchange's own counters: ``served``: (3,) int64 rows it served from the cache / host (`_serve`),
        # ``hits``: () int64 rows of other shards its batch found in this rank's cache (`_prepare_slots`)
        self.served: torch.Tensor | None = None
        self.hits: torch.Tensor | None = None
        self.prep_counts_s = self.host_s = self.cpu_s = self.wait_s = self.prep_rest_s = 0.0


class _Piece(NamedTuple):
    """One all_to_all of rows: ``got`` (m, *rest) receives ``recv[j]`` rows from each rank ``j`` while
    ``send[j]`` go to it (the rows of ``wanted[sel]``, all of ``wanted`` when ``sel`` is None, served
    into ``out`` if not None), then ``dest[where] = got``."""

    got: torch.Tensor
    recv: list[int]
    send: list[int]
    sel: torch.Tensor | None
    where: torch.Tensor
    out: torch.Tensor | None


class _Record(NamedTuple):
    """One finished exchange's statistics (`ExchangeSteps._publish`), folded by `ShardedTier._fold` once ``done``
    (None on a CPU, else a CUDA event after everything below) has completed.

    ``stages``: seconds of its counts, ids and rows stages, or on CUDA the events that time them (start, sorted,
    submitted, counted; resumed, ids sent, rows placed); ``counters``: (rows served from the cache, rows of other
    shards found in the cache), ints, or on CUDA a pinned (2,) int64 copy (None: no counter).
    """

    stages: tuple[Any, ...]
    counters: Any
    done: Any

    def resolve(self) -> tuple[tuple[float, float, float], tuple[int, int]]:
        """(counts, ids, rows) seconds and the two counters (``done`` complete)."""
        if self.done is None:
            return self.stages, self.counters
        a, z, u, c, r, m, b = self.stages
        stages = ((a.elapsed_time(z) + u.elapsed_time(c)) / 1e3, r.elapsed_time(m) / 1e3, m.elapsed_time(b) / 1e3)
        counters = (0, 0) if self.counters is None else tuple(int(v) for v in self.counters.tolist())
        return stages, counters


def _host_counts(c: _Counts) -> list[list[int]]:
    """The counts matrix on the host: the one wait of an exchange (for the all_gather and the copy behind it only)."""
    if c.work is not None:
        c.work.wait()
        flat = c.out.tolist()
    else:
        c.ready.synchronize()  # sleeps without the interpreter lock; later work on the stream is not waited for
        flat = c.host.tolist()
    w = int(round(len(flat) ** 0.5))
    return [flat[i * w:(i + 1) * w] for i in range(w)]


def _event() -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
