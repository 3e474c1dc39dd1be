"""`FeatureStore`: ``feats[cuda_idx]`` answered from tiers, fastest first.

    feats = FeatureStore("data/features.npy", gpu_cache="25%", host_memory="16GB", hotness=graph)
    loader = NeighborLoader(graph, train_idx, [15, 10, 5], features=feats, labels=labels)
    x = feats[cuda_idx]                       # (m, F) CUDA: cache hits, host rows, disk rows in one batch
    feats.stats()                             # per tier: rows, bytes, seconds, hit rate

Tiers (each row lives in exactly one, chosen by hotness: the hottest rows in the GPU cache,
the next in host memory, the rest on disk):

- ``gpu_cache``: rows in GPU memory, within the ``gpu_cache`` budget;
- ``host``: pinned host memory read by the GPU over PCIe (zero copy).  A table given as a
  tensor is itself the host tier (pinned in place); a table given as a file gets a pinned
  copy of as many rows as ``host_memory`` allows;
- ``disk``: the rest of a file-backed table, read page by page with O_DIRECT
  (`datapath.features.disk`).

One kernel (`datapath.memory.gather_tiered`) serves the GPU cache and host rows of a batch
while the CPU reads its disk rows.  Indices are bounds-checked like every row fetch of
datapath (`datapath.memory.gather_rows`): an out-of-range index raises ``IndexError``
naming it, and the CUDA context survives.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from datapath._runtime.pinned import pin_limit_bytes, pinned_empty
from datapath.features import _build
from datapath.features.budget import format_bytes, parse_budget
from datapath.features.disk import DiskTier
from datapath.features.disk_options import DiskOptions
from datapath.features.errors import FeatureStoreError
from datapath.features.hotness import degree_hotness, rank
from datapath.features.pending_gather import PendingGather
from datapath.features.scan import BOUNCE_BUFFERS, DiskCosts, probe_disk
from datapath.features.superbatch import Schedule, StagingPool
from datapath.features.table_file import TableFile
from datapath.features.tiers import FetchTier, TierStats, with_hit_rate
from datapath.graph import Graph
from datapath.memory import (
    ErrorFlag, deferred_flag, gather_rows, gather_tiered, host_of, is_unified, placement_of, to_placement,
)
from datapath.unified_tensor import as_unified

log = logging.getLogger("datapath.features")


def _source(table: Any) -> TableFile | torch.Tensor:
    if isinstance(table, (str, os.PathLike)):
        return TableFile.open(Path(table))
    if isinstance(table, TableFile):
        return table
    if isinstance(table, np.ndarray):
        return as_unified(table) if torch.cuda.is_available() else torch.from_numpy(table)
    if isinstance(table, torch.Tensor):
        return table
    raise FeatureStoreError(f"table must be a tensor, a numpy array, a path or a TableFile; got {type(table).__name__}")


class FeatureStore:
    """Rows of an (N, *rest) table served from a GPU cache, pinned host memory and disk (see the module docstring).

    Args:
        table: a tensor (cuda, unified, pinned or pageable CPU: the host tier, pinned in place),
            a numpy array, a path to a ``.npy`` file, or a `TableFile` (raw rows in a file).
        gpu_cache: GPU memory for the hottest rows: ``"25%"`` (of the table's bytes), ``"10GB"``,
            ``"4GiB"``, a fraction, or bytes; None/0: no cache.
        host_memory: pinned host memory for a file-backed table's rows (same forms); rows beyond it are
            read from disk.  None: the whole table when it fits what can be pinned, else half of that.
            A tensor table is the host tier itself, so it takes no ``host_memory`` smaller than itself.
        hotness: (N,) scores (higher = hotter; `presample_hotness`, `degree_hotness`), or a `Graph`
            (its in-degrees).  None: rows in id order (the first rows are cached).
        device: where batches go (default: the current CUDA device, else the CPU).
        disk: `DiskOptions` of the disk tier.
    """

    def __init__(self, table: Any, *, gpu_cache: str | float | int | None = None,
                 host_memory: str | float | int | None = None, hotness: torch.Tensor | Graph | None = None,
                 device: str | torch.device | None = None, disk: DiskOptions | None = None) -> None:
        src = _source(table)
        self._setup(tuple(src.shape), src.dtype, device)
        cache_bytes = parse_budget(gpu_cache, self.nbytes, "gpu_cache") or 0
        if cache_bytes > self.nbytes:
            raise FeatureStoreError(f"gpu_cache={gpu_cache!r} ({format_bytes(cache_bytes)}) is larger than the table "
                                    f"({format_bytes(self.nbytes)}); give at most '100%'")
        host_bytes = parse_budget(host_memory, self.nbytes, "host_memory")
        c = min(self.num_rows, cache_bytes // self.row_bytes) if self.row_bytes else 0
        if isinstance(src, TableFile):
            self._build_from_file(src, c, host_bytes, hotness, disk or DiskOptions())
        else:
            self._build_from_tensor(src, c, host_bytes, hotness)
        self.cache_rows = 0 if self._cache is None else int(self._cache.shape[0])
        log.info("feature store %s", self.describe())

    @classmethod
    def from_tiers(cls, shape: tuple[int, ...], dtype: torch.dtype, *, cache: torch.Tensor | None,
                   host: torch.Tensor | None, slots: torch.Tensor, fetch: list[FetchTier],
                   device: str | torch.device | None = None) -> "FeatureStore":
        """A store over tiers built elsewhere (`datapath.features.sharded_store` builds one).

        ``cache``: (c, *rest) on ``device`` or None; ``host``: (h, *rest) pinned (unified) memory, or
        CPU memory for a CPU store; ``slots``: (N,) int32 on ``device``: ``1..c`` a cache row,
        ``c+1..c+h`` a host row, ``-(k+1)`` a row of ``fetch[k]``; ``fetch``: the `FetchTier` s.
        """
        self = cls.__new__(cls)
        self._setup(tuple(shape), dtype, device)
        if slots.shape != (self.num_rows,) or slots.dtype != torch.int32 or slots.device != self.device:
            raise FeatureStoreError(f"slots must be ({self.num_rows},) int32 on {self.device}, got {slots.dtype} "
                                    f"{tuple(slots.shape)} on {slots.device}")
        self._cache, self._host, self._slots, self._fetch = cache, host, slots, list(fetch)
        self.cache_rows = 0 if cache is None else int(cache.shape[0])
        log.info("feature store %s", self.describe())
        return self

    def _setup(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device | None) -> None:
        """The table's facts, the device, and empty tiers and counters."""
        self.shape = shape
        if len(self.shape) < 1:
            raise FeatureStoreError("a feature table needs at least one dimension (rows)")
        self.dtype = dtype
        self.num_rows = int(self.shape[0])
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()
        self.nbytes = self.num_rows * self.row_bytes
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cache = self._host = self._slots = self._direct = None
        self._fetch: list[FetchTier] = []
        self._pool: StagingPool | None = None
        self._schedules: list[Schedule] = []
        self.disk_costs: DiskCosts | None = None
        self._gpu_stats, self._host_stats = TierStats(), TierStats()
        # each gather's own counters and times (`_Gathered`): the gathering threads append, `stats` and
        # `reset_stats` (any thread) fold the finished ones into the two stats above, all under this lock
        self._gathers: list[_Gathered] = []
        self._stats_lock = threading.Lock()
        self._unread = False  # a gather was published since the statistics were last read (CUDA: they synchronise)

    # -- building ----------------------------------------------------------------------------
    def _order(self, hotness: torch.Tensor | Graph | None) -> torch.Tensor:
        if hotness is None:
            log.warning("no hotness given: the GPU cache and host tier hold the first rows; pass hotness= "
                        "(datapath.features.presample_hotness(...) or the graph) to cache the hot ones")
            return torch.arange(self.num_rows)
        scores = degree_hotness(hotness) if isinstance(hotness, Graph) else torch.as_tensor(hotness)
        if scores.shape != (self.num_rows,):
            raise FeatureStoreError(f"hotness must hold one score per row ({self.num_rows},), got "
                                    f"{tuple(scores.shape)}")
        return rank(scores)

    def _build_from_tensor(self, t: torch.Tensor, c: int, host_bytes: int | None, hotness: Any) -> None:
        where = placement_of(t)
        if not host_of(t).is_contiguous() if where != "cuda" else not t.is_contiguous():
            log.info("the table's rows are not contiguous: the store keeps a contiguous copy")
            t = to_placement(host_of(t).contiguous() if where != "cuda" else t.contiguous(), where)
            where = placement_of(t)
        if where == "cuda" or c == self.num_rows:
            self._direct = t if where == "cuda" else gather_rows(t, torch.arange(self.num_rows, device=self.device))
            self._direct_stats = self._gpu_stats if self._direct.device.type == "cuda" else self._host_stats
            if where != "cuda":
                self._cache = self._direct
            return
        if host_bytes is not None and host_bytes < self.nbytes - c * self.row_bytes:
            raise FeatureStoreError(
                f"host_memory={format_bytes(host_bytes)} is less than the {format_bytes(self.nbytes)} table given in "
                f"memory, so rows would have to come from disk: pass the table as the path of its .npy file "
                f"(FeatureStore('features.npy', ...)), or leave host_memory out")
        # as_unified also for memory that is pinned already: the store then holds a reference on the pinning
        # (a tensor pinned in place by another unified tensor would be unpinned when that one is freed)
        host = t if is_unified(t) or self.device.type == "cpu" else as_unified(t)
        self._host = host
        if c == 0:
            self._direct, self._direct_stats = host, self._host_stats
            return
        order = self._order(hotness)
        cache_ids = order[:c].to(self.device)
        self._cache = gather_rows(host, cache_ids)
        self._slots = _build.slot_map(self.num_rows, cache_ids, None, self.device)

    def _build_from_file(self, tf: TableFile, c: int, host_bytes: int | None, hotness: Any,
                         disk: DiskOptions) -> None:
        rest = self.num_rows - c
        if host_bytes is None:
            fits = rest * self.row_bytes <= pin_limit_bytes() if self.device.type == "cuda" else True
            host_bytes = rest * self.row_bytes if fits else pin_limit_bytes() // 2
        staging = parse_budget(disk.superbatch, self.nbytes, "disk.superbatch") or 0
        if staging:
            if disk.buffers not in (1, 2):
                raise FeatureStoreError(f"disk.buffers must be 1 or 2, got {disk.buffers!r}")
            if disk.bounce_bytes < disk.scan_read_bytes:
                raise FeatureStoreError(f"disk.bounce_bytes={disk.bounce_bytes} must be at least disk.scan_read_bytes "
                                        f"({disk.scan_read_bytes})")
            need = staging + BOUNCE_BUFFERS * disk.bounce_bytes
            if need > host_bytes:
                raise FeatureStoreError(
                    f"disk.superbatch={disk.superbatch!r} needs {format_bytes(need)} of host memory (with {BOUNCE_BUFFERS} "
                    f"{format_bytes(disk.bounce_bytes)} bounce buffers) but host_memory is "
                    f"{format_bytes(host_bytes)}; give a smaller superbatch or more host_memory")
            host_bytes -= need
        h = min(rest, host_bytes // self.row_bytes) if self.row_bytes else rest
        order = self._order(hotness) if (c or h < rest) else torch.arange(self.num_rows)
        cache_ids, host_ids = order[:c], order[c:c + h]
        slots = _build.slot_map(self.num_rows, cache_ids, host_ids, torch.device("cpu"))
        rest_shape = tuple(self.shape[1:])
        self._cache = torch.empty((c, *rest_shape), dtype=self.dtype, device=self.device) if c else None
        host = pinned_empty((h, *rest_shape), self.dtype) if self.device.type == "cuda" else \
            torch.empty((h, *rest_shape), dtype=self.dtype)
        _build.fill_from_file(tf, slots.numpy(), c, self._cache, host if h else None)
        self._host = host
        if h < rest:
            self._fetch.append(DiskTier(tf, self.device, disk.engine, disk.depth, disk.max_read_bytes))
            if staging:
                self._pool = StagingPool(staging // disk.buffers, disk.buffers, self.device.type == "cuda",
                                         disk.bounce_bytes)
                self._pool.allocate()
                self._disk_opts = disk
                self.disk_costs = disk.costs
        if c == 0 and h == self.num_rows:  # everything in host memory, in row order
            self._direct, self._direct_stats = host, self._host_stats
            return
        self._slots = slots.to(self.device)

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"a FeatureStore is indexed by an int32/int64 tensor of row ids, got {type(idx).__name__}")
        return self.gather(idx)

    def schedule(self, steps: list[int], input_nodes: Callable[[int], torch.Tensor]) -> Schedule | None:
        """Superbatches for one epoch of a loader (None when the store has no superbatch disk tier).

        ``steps``: the loader's step numbers of the epoch's batches, in order; ``input_nodes(k)``: the
        node ids batch ``k`` (an index into ``steps``) will gather, sampled as the loader samples it
        (called from a planner thread, on a CUDA stream of its own).  Pass ``schedule=`` and
        ``step=`` to `gather`; `Schedule.close` when the epoch ends or is abandoned.
        """
        if self._pool is None:
            return None
        tier = self._fetch[0]
        if self.disk_costs is None:
            self.disk_costs = probe_disk(tier.table, random_reads=20_000, depths=(256,), seq_bytes=1 << 30,
                                         seq_read_bytes=self._disk_opts.scan_read_bytes,
                                         bounce_bytes=self._disk_opts.bounce_bytes)
            log.info("disk costs of %s: %s", tier.table.path, self.disk_costs.as_dict())
        self._schedules = [s for s in self._schedules if s.alive]
        slots = self._slots

        def on_disk(ids: torch.Tensor) -> torch.Tensor:
            ids = ids.to(slots.device).long()
            return ids[slots[ids] < 0]

        sched = Schedule(tier, list(steps), input_nodes, on_disk, self._pool, self.disk_costs, self.device,
                         self._disk_opts.scan_read_bytes)
        self._schedules.append(sched)
        return sched

    @property
    def collective(self) -> bool:
        """Whether a tier is collective (a shard of a ``torch.distributed`` group): every gather of every rank
        pairs up in an exchange, so gathers must be finished in the same order on every rank."""
        return any(t.collective for t in self._fetch)

    def gather(self, idx: torch.Tensor, error_flag: ErrorFlag | None = None, *, schedule: Schedule | None = None,
               step: int | None = None) -> torch.Tensor:
        """Rows ``idx`` (int32/int64, any shape, any device; negatives count from the end) on the store's device.

        Returns (*idx.shape, *rest).  An out-of-range index raises ``IndexError`` (see
        `datapath.memory.gather_rows`; with ``error_flag`` the caller checks it).  ``schedule``/``step``:
        the loader's superbatch `Schedule` and this batch's step (its disk rows come from there).
        """
        return self.start_gather(idx, error_flag, schedule=schedule, step=step).finish()

    def start_gather(self, idx: torch.Tensor, error_flag: ErrorFlag | None = None, *,
                     schedule: Schedule | None = None, step: int | None = None,
                     defer: bool = False) -> "PendingGather":
        """`gather` in two parts: this one launches the read of the rows the GPU addresses (cache, host) on the
        current stream; `PendingGather.finish` fills the rest from the fetch tiers (disk, other ranks' shards).

        A loader finishes a collective store's gathers on a thread and stream of its own, so that the
        exchange with the other ranks overlaps the next batches' sampling.  ``defer``: the caller finishes
        (or, if this call raises, calls `abort`) in its own order; otherwise a failure here tells the other
        ranks at once.
        """
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
            raise TypeError("FeatureStore rows are read with an int32/int64 index tensor")
        if idx.device != self.device:
            idx = idx.to(self.device)
        flat = idx.reshape(-1)
        shape = (*idx.shape, *self.shape[1:])
        if self._direct is not None:
            start = self._timed()
            rows = gather_rows(self._direct, flat, error_flag)
            n = flat.numel()
            self._publish((n, 0) if self._direct_stats is self._gpu_stats else (0, n), start)
            return PendingGather(self, rows, shape)
        own_flag = error_flag is None and self.device.type == "cuda"
        if own_flag:
            error_flag = deferred_flag()  # one flag for the lookup and the gather (raised by the next fetch)
        try:
            loc = gather_rows(self._slots, flat, error_flag)
            out = torch.empty((flat.numel(), *self.shape[1:]), dtype=self.dtype, device=self.device)
        except BaseException as exc:
            if not defer:
                self.abort(exc)
            raise
        empty = torch.empty((0, *self.shape[1:]), dtype=self.dtype, device=self.device)
        counts = torch.zeros(3, dtype=torch.int64, device=self.device)  # this gather's own (cache, host, other)
        start = self._timed()
        gather_tiered(self._cache if self._cache is not None else empty,
                      self._host if self._host is not None else empty, loc, out,
                      error_flag=error_flag, counts=counts)
        self._publish(counts, start)
        return PendingGather(self, out, shape, flat, loc, error_flag if own_flag else None, schedule, step)

    def abort(self, error: BaseException) -> None:
        """This rank's gather failed with ``error`` before its fetch tiers ran: the collective ones tell the others."""
        for t in self._fetch:
            if t.collective:
                t.abort(error)

    def _fetch_missing(self, flat: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, own_flag: ErrorFlag | None,
                       schedule: Schedule | None, step: int | None) -> None:
        """Fill the rows of ``out`` that the GPU-read tiers left (``loc < 0``) from the fetch tiers."""
        collective = self.collective
        if not (self._fetch and (flat.numel() or collective)):
            return
        if len(self._fetch) == 1 and self._fetch[0].reads_slots and schedule is None:
            self._fetch[0].fetch_slots(flat, loc, out, own_flag)  # no host synchronisation here: the tier's own
            return
        try:
            pos = (loc < 0).nonzero().squeeze(1)  # the one host synchronisation of a batch with fetched rows
            if own_flag is not None:
                own_flag.raise_if_set()  # the lookup has run: a bad index is raised before any fetch
            if not (pos.numel() or collective):
                return
            ids = flat[pos].long()
            ids, codes = torch.where(ids < 0, ids + self.num_rows, ids), loc[pos]
        except BaseException as exc:
            self.abort(exc)  # the other ranks wait in the exchange: tell them
            raise
        for k, tier in enumerate(self._fetch):
            mine = (codes == -(k + 1)).nonzero().squeeze(1) if len(self._fetch) > 1 else None
            if tier.collective or (ids.numel() if mine is None else mine.numel()):
                args = (ids if mine is None else ids[mine], pos if mine is None else pos[mine], out)
                if schedule is not None and schedule.tier is tier and step is not None:
                    schedule.fetch(step, *args)
                else:
                    tier.fetch(*args)

    def _timed(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream (CUDA only)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _publish(self, rows: torch.Tensor | tuple[int, int], start: torch.cuda.Event | None) -> None:
        """Hand one gather's statistics to `_fold`: its rows from the cache and the host tier (``rows``: ints, or
        the (3,) int64 counters its tiered gather wrote) and, on CUDA, its GPU time (from ``start``).

        On CUDA the counters are copied to pinned memory behind the gather on the current stream (its stream),
        and the record is folded once an event after that copy has completed; on a CPU they are read now.
        """
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if isinstance(rows, torch.Tensor):
                host = pinned_empty((3,), torch.int64)
                host.copy_(rows, non_blocking=True)
                rows = host
            done = torch.cuda.Event()
            done.record()
            rec = _Gathered(rows, start, end, done)
        else:
            rec = _Gathered(tuple(rows.tolist()[:2]) if isinstance(rows, torch.Tensor) else rows, None, None, None)
        with self._stats_lock:
            self._gathers.append(rec)
            self._unread = True
            if rec.done is None or len(self._gathers) > 4096:
                self._fold()

    def _fold(self) -> None:
        """Add the finished gathers' rows, bytes and GPU time to the cache's and host tier's statistics (the caller
        holds ``_stats_lock``; nothing here waits for the GPU: an unfinished gather stays for a later fold).

        The counts cannot tear: each gather's tiered kernel adds to counters of its own, which nothing writes
        after the gather (on CUDA their pinned copy is read only once the event recorded after the copy, on the
        gather's stream, has completed); a record is taken from the list under the lock, so it is folded exactly
        once; and `reset_stats` reads and zeroes under the same lock, so each gather falls wholly before or after
        a reset.  No counter is read and then zeroed while another thread (or a stream) adds to it.
        """
        ready, keep = [], []
        for rec in self._gathers:
            (ready if rec.done is None or rec.done.query() else keep).append(rec)
        self._gathers = keep
        for rec in ready:
            cache_rows, host_rows = (int(v) for v in (rec.rows.tolist()[:2] if isinstance(rec.rows, torch.Tensor)
                                                      else rec.rows))
            # one kernel reads both tiers: its GPU time is theirs together
            seconds = 0.0 if rec.start is None else rec.start.elapsed_time(rec.end) / 1e3
            self._gpu_stats.add(cache_rows, cache_rows * self.row_bytes, seconds)
            self._host_stats.add(host_rows, host_rows * self.row_bytes, seconds)

    # -- facts -------------------------------------------------------------------------------
    @property
    def host_rows(self) -> int:
        return 0 if self._host is None else int(self._host.shape[0])

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Rows and bytes each tier holds (plus the GPU memory of the slot map)."""
        out = {"gpu_cache": {"rows": self.cache_rows, "bytes": self.cache_rows * self.row_bytes},
               "host": {"rows": self.host_rows, "bytes": self.host_rows * self.row_bytes}}
        for t in self._fetch:
            rows = self.num_rows - self.cache_rows - self.host_rows if t.rows is None else t.rows
            out[t.name] = {"rows": rows, "bytes": rows * self.row_bytes, "engine": getattr(t, "engine", None)}
        if self._pool is not None:
            out["disk"].update(staging_bytes=self._pool.total_bytes, staging_buffers=self._pool.count,
                               direct=self._fetch[0].reader.direct)
        out["slot_map_bytes"] = 0 if self._slots is None else self._slots.numel() * 4
        return out

    def describe(self) -> str:
        t = self.tiers()
        parts = [f"{name} {format_bytes(v['bytes'])} ({v['rows']:,} rows)" for name, v in t.items()
                 if isinstance(v, dict) and v["rows"]]
        return f"({self.num_rows:,} x {self.row_bytes} B rows, {format_bytes(self.nbytes)}): " + ", ".join(parts)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier since the last `reset_stats`: rows, bytes, seconds, hit rate (share of all rows returned).

        ``seconds`` of ``gpu_cache`` and ``host`` is the GPU time of the gathers that read them
        (one kernel serves both, so it is the same number); of ``disk``, the wall time of its fetches.
        """
        return self._read_stats(reset=False)

    def reset_stats(self) -> dict[str, dict[str, Any]]:
        """Zero the statistics; returns them as they were (what `stats` would have returned), read and zeroed at
        once: a gather running meanwhile on another thread is counted either there or in the next statistics."""
        return self._read_stats(reset=True)

    def _read_stats(self, reset: bool) -> dict[str, dict[str, Any]]:
        """`stats`, and with ``reset`` each tier's counters zeroed in the instant they are read."""
        if self._unread and self.device.type == "cuda":
            self._unread = False  # (set again by a gather published after this)
            torch.cuda.synchronize(self.device)  # the gathers may run on the loader's streams (waited on unlocked)
        fetch = [(t.name, t.stats) for t in self._fetch]  # (a sharded tier folds its finished exchanges here)
        with self._stats_lock:
            self._fold()
            snaps = {"gpu_cache": self._gpu_stats.snapshot(reset), "host": self._host_stats.snapshot(reset),
                     **{name: s.snapshot(reset) for name, s in fetch}}
        total = sum(s["rows"] for s in snaps.values())
        return {name: with_hit_rate(s, total) for name, s in snaps.items()}

    def close(self) -> None:
        """Stop the superbatch schedules and close the disk tier's file (idempotent)."""
        for sched in self._schedules:
            sched.close()
        self._schedules = []
        for t in self._fetch:
            t.close()

    def __repr__(self) -> str:
        return f"FeatureStore{self.describe()}"


class _Gathered(NamedTuple):
    """One gather's statistics (`FeatureStore._publish`), folded by `FeatureStore._fold` once ``done`` (None on a
    CPU, else a CUDA event after everything below) has completed.

    ``rows``: (rows from the GPU cache, rows from the host tier), ints, or on CUDA a pinned (3,) int64 copy of the
    tiered kernel's counters; ``start``/``end``: CUDA timing events around the gather (None on a CPU).
    """

    rows: Any
    start: Any
    end: Any
    done: Any
