"""Superbatches (Ginex): the disk rows of many batches read at once, and each batch served from memory.

A `Schedule` is made by a loader for one epoch (`FeatureStore.schedule`): it knows the
batches to come and how to sample one (``input_nodes(k)``, the same pure function of
the step the loader samples with).  Two threads walk ahead of the loader:

1. the planner samples batches ``k, k+1, ...`` and marks their disk rows (deduplicated: a
   row several batches need is read once) until the superbatch's distinct rows fill a
   staging buffer, and lets `datapath.features.scan.choose_gap` pick, by the disk's
   measured costs, the reads: only the needed pages (random reads where rows are sparse),
   one sequential scan of the file, or merges in between;
2. the reader waits for a free staging buffer (pinned host memory, counted in the store's
   host memory) and `read_rows` puts exactly the needed rows, sorted by id, into it;
3. the loader's gathers of those batches (`fetch`) find their rows there (a binary search
   on the device) and copy them zero-copy; after the superbatch's last batch the buffer
   is handed back (once the GPU has read it) and the next superbatch is read into it.

The next superbatch is planned while the current one is read and trains; with two
buffers (``buffers=2``) its reads overlap the current one's training too, at half the
rows per superbatch (one buffer is the better trade where reading takes far longer than
training).
A batch the schedule does not know (another loader, evaluation) is read row by row as
before.  A read error raises `DiskReadError` (file and offset) in the gather of every batch
of the failed superbatch; no row of it is served.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from datapath.features.disk import DiskReader, ReadPlan
from datapath.features.scan import BOUNCE_BUFFERS, BOUNCE_BYTES, DiskCosts, GapChoice, _aligned, choose_gap, plan_rows, read_rows
from datapath.memory import gather_rows
from datapath.unified_tensor import as_unified, host_tensor

if TYPE_CHECKING:
    from datapath.features.disk import DiskTier

log = logging.getLogger("datapath.features.superbatch")


def _staging_buffer(nbytes: int, pinned: bool) -> tuple[torch.Tensor, Any]:
    """A page-aligned host buffer of exactly ``nbytes``, pinned in place for GPU reads when ``pinned``
    (cudaHostRegister: a pinned allocation of PyTorch's caching allocator would be rounded up to a power
    of two), and the unified tensor that holds its pinning."""
    buf = _aligned(nbytes)
    if not pinned:
        return buf, None
    u = as_unified(buf)
    return host_tensor(u), u


class StagingPool:
    """``buffers`` page-aligned host buffers of ``nbytes`` each (pinned for a CUDA store), allocated on first use;
    `acquire` waits for a free one (and for the GPU reads of its last use), `release` hands one back."""

    def __init__(self, nbytes: int, buffers: int, pinned: bool, bounce_bytes: int = BOUNCE_BYTES) -> None:
        self.nbytes, self.count, self.pinned = int(nbytes), int(buffers), pinned
        self.bounce_bytes = int(bounce_bytes)
        self._free: list[int] = list(range(self.count))
        self._bufs: list[torch.Tensor | None] = [None] * self.count
        self._handles: list[Any] = [None] * self.count  # the pinning of each buffer
        self._done: list[list[Any]] = [[] for _ in range(self.count)]  # CUDA events of the buffer's last reads
        self._cv = threading.Condition()
        self.bounce = [_aligned(self.bounce_bytes) for _ in range(BOUNCE_BUFFERS)]

    def allocate(self) -> None:
        """Allocate (and pin) every buffer now rather than on first use."""
        for i in range(self.count):
            if self._bufs[i] is None:
                self._bufs[i], self._handles[i] = _staging_buffer(self.nbytes, self.pinned)

    @property
    def total_bytes(self) -> int:
        """Host memory the pool holds once allocated (staging buffers and the bounce buffers)."""
        return self.nbytes * self.count + len(self.bounce) * self.bounce_bytes

    def acquire(self, stop: threading.Event) -> tuple[int, torch.Tensor] | None:
        with self._cv:
            while not self._free:
                if stop.is_set():
                    return None
                self._cv.wait(0.1)
            i = self._free.pop(0)
        for event in self._done[i]:
            event.synchronize()
        self._done[i] = []
        if self._bufs[i] is None:
            self._bufs[i], self._handles[i] = _staging_buffer(self.nbytes, self.pinned)
        return i, self._bufs[i]

    def release(self, i: int, done: list[Any] | None = None) -> None:
        """Hand buffer ``i`` back; ``done``: CUDA events after which the GPU no longer reads it."""
        with self._cv:
            self._done[i] = list(done or [])
            self._free.append(i)
            self._cv.notify_all()


@dataclass
class _Super:
    """One superbatch: schedule indices ``first..last-1``, its sorted row ids (on the store's device) and rows."""

    number: int
    first: int
    last: int
    buffer: int = -1
    ids: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)  # batches whose rows alone overflow a buffer: read as before
    events: list[Any] = field(default_factory=list)  # CUDA events after each batch's reads of the buffer
    error: BaseException | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Schedule:
    """One epoch's superbatches for a `DiskTier` (see the module docstring; made by `FeatureStore.schedule`).

    Args:
        tier: the disk tier.
        steps: the loader's step numbers of the epoch's batches, in order.
        input_nodes: ``input_nodes(k)``: (m,) int64 node ids (device of the store) whose rows batch ``k``
            (an index into ``steps``) gathers; called from the planner thread.
        on_disk: ``on_disk(ids)``: the ids among ``ids`` that ``tier`` serves.
        pool: the staging buffers.
        costs: the disk's costs (`probe_disk`).
        device: the store's device.
    """

    def __init__(self, tier: "DiskTier", steps: list[int], input_nodes: Callable[[int], torch.Tensor],
                 on_disk: Callable[[torch.Tensor], torch.Tensor], pool: StagingPool, costs: DiskCosts,
                 device: torch.device, max_read_bytes: int = 1 << 20) -> None:
        self.tier, self.pool, self.costs, self.device = tier, pool, costs, device
        self._index = {s: k for k, s in enumerate(steps)}
        self._n = len(steps)
        self._input_nodes, self._on_disk = input_nodes, on_disk
        self.max_read_bytes = int(max_read_bytes)
        self.row_bytes = tier.table.row_bytes
        self.capacity_rows = pool.nbytes // self.row_bytes if self.row_bytes else 0
        self._supers: dict[int, _Super] = {}  # by superbatch number, published when read
        self._of: dict[int, int] = {}  # schedule index -> superbatch number (once planned)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stop_planning = threading.Event()
        self._plans: queue.Queue = queue.Queue(maxsize=1)  # planned, not yet read (one ahead of the reads)
        self._threads = [threading.Thread(target=self._plan_loop, name="datapath-superbatch-plan", daemon=True),
                         threading.Thread(target=self._read_loop, name="datapath-superbatch-read", daemon=True)]
        for t in self._threads:
            t.start()

    # -- the planner and reader threads ------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()
        self._stop_planning.set()

    def _plan_loop(self) -> None:
        """Plan superbatch after superbatch (sample, mark, choose the reads) into ``_plans``, one ahead of the
        reads: the next superbatch is planned while the current one is read."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            if stream is not None:
                torch.cuda.set_device(self.device)
            mark = torch.zeros(self.tier.table.num_rows, dtype=torch.bool, device=self.device)
            k, number, carry = 0, 0, None
            while k < self._n and not self._stop_planning.is_set():
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    sb, carry = self._plan(number, k, mark, carry)
                    ids = mark.nonzero().squeeze(1)
                    mark[ids] = False
                    ids_np = ids.cpu().numpy()
                if self._stop_planning.is_set():
                    return
                t0 = time.perf_counter()
                choice = choose_gap(ids_np, self.tier.table.offset, self.row_bytes, self.costs, self.max_read_bytes)
                plan = plan_rows(self.tier.table, ids_np, choice.max_gap_pages, self.max_read_bytes,
                                 self.pool.bounce_bytes)
                sb.info["choose_s"] = time.perf_counter() - t0
                self._publish_plan(sb)
                while not self._stop_planning.is_set():
                    try:
                        self._plans.put((sb, ids, ids_np, choice, plan), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                k, number = sb.last, number + 1
        except BaseException as exc:  # noqa: BLE001 - raised by the gathers that wait for it
            self._fail(exc)
        finally:
            while True:  # the reader's end
                try:
                    self._plans.put(None, timeout=0.1)
                    break
                except queue.Full:
                    if self._stop.is_set() or not self._threads[1].is_alive():
                        break

    def _read_loop(self) -> None:
        """Read each planned superbatch into a free staging buffer and publish it."""
        readers: list[DiskReader] = []
        try:
            engine = self.tier.reader.engine if self.tier.reader.engine != "kvikio" else "auto"
            for _ in self.pool.bounce:  # readers of its own (own AIO contexts), one per bounce buffer
                readers.append(DiskReader(self.tier.table, engine, self.tier.reader_depth))
            while True:
                try:
                    item = self._plans.get(timeout=0.1)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                if item is None or self._stop.is_set():
                    return
                sb, ids, ids_np, choice, plan = item
                t0 = time.perf_counter()
                got = self.pool.acquire(self._stop)
                if got is None:
                    return
                sb.info["wait_buffer_s"] = time.perf_counter() - t0
                sb.buffer, buf = got
                try:
                    self._read(sb, readers, ids, ids_np, buf, choice, plan)
                except BaseException as exc:  # noqa: BLE001 - handed to the batches of this superbatch
                    sb.error = exc
                    self.pool.release(sb.buffer)
                if self._stop.is_set():  # closed during the reads: the buffer may be incomplete
                    if sb.error is None:
                        self.pool.release(sb.buffer)
                    return
                with self._cv:
                    self._supers[sb.number] = sb
                    self._cv.notify_all()
                if sb.error is not None:  # no later superbatch is read: the loader stops at this one
                    self._stop_planning.set()
                    return
        except BaseException as exc:  # noqa: BLE001 - raised by the gathers that wait for it
            self._fail(exc)
        finally:
            self._stop_planning.set()
            for r in readers:
                r.close()

    def _plan(self, number: int, k: int, mark: torch.Tensor,
              carry: tuple[int, torch.Tensor] | None) -> tuple[_Super, tuple[int, torch.Tensor] | None]:
        """Mark the disk rows of batches ``k, k+1, ...`` until the next would overflow a buffer."""
        sb = _Super(number, k, k)
        count = 0
        t0 = time.perf_counter()
        while sb.last < self._n and not self._stop.is_set():
            if carry is not None and carry[0] == sb.last:
                disk = carry[1]
            else:
                disk = self._on_disk(self._input_nodes(sb.last))
            carry = None
            new = disk[~mark[disk]]
            n_new = int(new.numel())  # a host sync per batch (the planner's own stream)
            if n_new > self.capacity_rows:  # this batch alone overflows a buffer: it is read row by row
                sb.skipped.add(sb.last)
                sb.last += 1
                continue
            if count + n_new > self.capacity_rows:
                carry = (sb.last, disk)
                break
            mark[new] = True
            count += n_new
            sb.last += 1
        sb.pending = set(range(sb.first, sb.last)) - sb.skipped
        sb.info.update(batches=sb.last - sb.first, skipped=len(sb.skipped), plan_s=time.perf_counter() - t0)
        return sb, carry

    def _publish_plan(self, sb: _Super) -> None:
        with self._cv:
            for k in range(sb.first, sb.last):
                self._of[k] = sb.number
            self._cv.notify_all()

    def _read(self, sb: _Super, readers: list[DiskReader], ids: torch.Tensor, ids_np: np.ndarray,
              buf: torch.Tensor, choice: GapChoice, plan: ReadPlan) -> None:
        n = ids_np.size
        out = buf[: n * self.row_bytes].view(n, self.row_bytes)
        res = read_rows(readers, self.tier.table, ids_np, out, choice.max_gap_pages, self.max_read_bytes,
                        self.pool.bounce, self._stop, plan)
        rest = tuple(self.tier.table.shape[1:])
        sb.rows = buf[: n * self.row_bytes].view(self.tier.table.dtype).view(n, *rest)
        sb.ids = ids
        sb.info.update(rows=n, useful_bytes=n * self.row_bytes, mode=choice.mode, buffer=sb.buffer,
                       max_gap_pages=choice.max_gap_pages, predicted_s=choice.seconds, reads=res.reads,
                       read_bytes=res.read_bytes, io_s=res.io_s, read_s=res.seconds,
                       read_GBps=res.read_bytes / res.io_s / 1e9 if res.io_s else None)
        self.tier.count_reads(res.reads, res.read_bytes, res.io_s, dict(sb.info, number=sb.number))
        log.info("superbatch %d: %d batches, %d rows, %s: %.2f GB in %.2f s (predicted %.2f s)", sb.number,
                 sb.info["batches"], n, choice.mode, res.read_bytes / 1e9, res.io_s, choice.seconds)

    # -- the loader's side -------------------------------------------------------------------
    def _wait(self, k: int) -> _Super:
        with self._cv:
            while True:
                if self._error is not None:
                    raise self._error
                number = self._of.get(k)
                if number is not None and number in self._supers:
                    return self._supers[number]
                if self._stop.is_set():
                    raise RuntimeError("the superbatch schedule was closed while a batch waited for it")
                self._cv.wait(0.1)

    def fetch(self, step: int, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """``out[positions] = table[ids]`` for the batch of loader step ``step`` (see `DiskTier.fetch`)."""
        k = self._index.get(step)
        if k is None:
            self.tier.fetch(ids, positions, out)
            return
        t0 = time.perf_counter()
        sb = self._wait(k)
        if sb.error is not None:
            raise sb.error
        if k in sb.skipped or k not in sb.pending:  # too many rows for a buffer, or a batch fetched again
            self.tier.fetch(ids, positions, out)
            return
        try:
            self._serve(sb, ids, positions, out, t0)
        finally:
            self._done(sb, k, out)

    def _serve(self, sb: _Super, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, t0: float) -> None:
        staged = sb.ids
        assert staged is not None and sb.rows is not None
        if staged.device.type == "cuda":  # made on the planner's stream, read on this one
            staged.record_stream(torch.cuda.current_stream(staged.device))
        ids = ids.to(staged.device)
        slot = torch.searchsorted(staged, ids).clamp_(max=max(staged.numel() - 1, 0))
        found = staged[slot] == ids if staged.numel() else torch.zeros_like(ids, dtype=torch.bool)
        missing = int((~found).sum())  # a host sync (the gather has made one already)
        if missing:  # a batch sampled differently from its plan: its other rows are read row by row
            self.tier.fetch(ids[~found], positions[~found.to(positions.device)], out)
            slot, positions = slot[found], positions[found.to(positions.device)]
        rows = gather_rows(sb.rows, slot.to(out.device)) if out.device.type == "cuda" else sb.rows.index_select(0, slot)
        out.index_copy_(0, positions, rows.view(-1, *out.shape[1:]))
        if out.device.type == "cuda":  # the buffer is reused once every stream that read it is past this
            event = torch.cuda.Event()
            event.record()
            with self._cv:
                sb.events.append(event)
        self.tier.count_staged(int(slot.numel()), missing, time.perf_counter() - t0)

    def _done(self, sb: _Super, k: int, out: torch.Tensor) -> None:
        with self._cv:
            sb.pending.discard(k)
            last = not sb.pending and sb.buffer >= 0 and sb.error is None
        if last:
            sb.ids = sb.rows = None
            self.pool.release(sb.buffer, sb.events)

    @property
    def alive(self) -> bool:
        """Whether its planner or reader thread still runs."""
        return any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Stop the planner and reader and hand back every staging buffer (idempotent)."""
        self._stop.set()
        self._stop_planning.set()
        for t in self._threads:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=60)
        with self._cv:
            for sb in self._supers.values():
                if sb.pending and sb.buffer >= 0 and sb.error is None:
                    sb.pending.clear()
                    sb.ids = sb.rows = None
                    self.pool.release(sb.buffer)
            self._cv.notify_all()
