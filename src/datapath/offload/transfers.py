"""Moving entries between device memory and a store: store and load jobs, forwarding, backpressure.

A store job copies a storage out once the kernel that produced it has finished
(the event recorded at pack time) and releases the device memory when the copy is
complete.  A load job copies it back into memory allocated on the consumer's
stream.  A storage needed while its store is queued is handed back from memory
(the store is cancelled); one whose store is running is handed back too (the
write stops between chunks).  `Transfers.admit` is the backpressure: a pack that
would put more than the in-flight bound waiting to be stored waits for stores to
finish, so the forward runs at the store's bandwidth instead of the allocator
growing.  All state is guarded by the lock it is given (the cache's).

Any exception in a store job -- its CUDA set-up, the write, waiting for its copy, its finishing -- ends the store
as failed (`Transfers._store_failed`: the bytes no longer in flight, the tensor kept in memory, the error raised in
the step or, with ``on_error="keep"``, a warning); any in a load job fails the load (raised where the tensor is
unpacked, or in the step when autograd already has it).  None is only logged: an entry never stays half-moved.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from datapath.offload.entry import FAILED, LOADING, PENDING, RESIDENT, STORED, STORING, Entry
from datapath.offload.errors import OffloadError
from datapath.offload.stats import OffloadStats
from datapath.offload.store import IOResult, Store, Streams
from datapath.offload._workers import Worker

log = logging.getLogger("datapath.offload.transfers")


def fresh(err: BaseException) -> BaseException:
    """A new exception like ``err`` to raise (the stored one stays free of this thread's frames)."""
    if isinstance(err, OffloadError):
        new = OffloadError(err.message, errno=err.errno, filename=err.filename)
        new.__cause__ = err.__cause__
        return new
    return err


class Transfers:
    """Entries, the store/load workers and streams, in-flight accounting, and the errors they raise."""

    def __init__(self, store: Store, lock: threading.RLock, stats: OffloadStats, on_error: str) -> None:
        self.store = store
        self.lock = lock
        self.space = threading.Condition(lock)
        self.stats = stats
        self.on_error = on_error
        self.entries: dict[int, Entry] = {}
        self.inflight_bytes = 0
        self.ahead_bytes = 0
        self.pending_error: BaseException | None = None
        self._streams: dict[torch.device, Streams] = {}
        self.store_workers: dict[str, Worker] = {}
        self.load_workers: dict[str, Worker] = {}

    # ------------------------------------------------------------ plumbing
    def streams_for(self, device: torch.device) -> Streams:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = Streams(device)
        return s

    def job_streams(self, device: torch.device) -> Streams | None:
        """A store or load job's set-up (worker thread): ``device`` made current and its streams; None off CUDA."""
        if device.type != "cuda":
            return None
        torch.cuda.set_device(device)
        return self.streams_for(device)

    def _worker(self, pool: dict[str, Worker], kind: str, what: str, window: int) -> Worker:
        w = pool.get(kind)
        if w is None:
            w = pool[kind] = Worker(f"datapath-{what}-{kind}", window=window)
        return w

    def run_in_store_worker(self, kind: str, job: Callable[[], Any]) -> None:
        """Queue ``job`` on the store worker of ``kind`` (ahead of the stores queued after it)."""
        self._worker(self.store_workers, kind, "store", 4).submit(job)

    def raise_pending(self) -> None:
        err = self.pending_error
        if err is not None:
            self.pending_error = None
            raise err

    def workers(self) -> list[Worker]:
        return list(self.store_workers.values()) + list(self.load_workers.values())

    def wait_idle(self) -> None:
        for w in self.workers():
            w.wait_idle()

    # -------------------------------------------------------- backpressure
    def admit(self, nbytes: int, bound: float) -> float:
        """Wait (lock held) until ``nbytes`` more in flight stays within ``bound``; the seconds waited."""
        if self.inflight_bytes + nbytes <= bound:
            return 0.0
        t0 = time.perf_counter()
        self.space.wait_for(lambda: self.inflight_bytes == 0 or self.pending_error is not None
                            or self.inflight_bytes + nbytes <= bound)
        waited = time.perf_counter() - t0
        self.stats.store_wait_seconds += waited
        self.raise_pending()
        return waited

    def admit_until(self, ready: Callable[[], bool]) -> float:
        """Wait (lock held) until ``ready()`` or nothing is in flight; the seconds waited."""
        t0 = time.perf_counter()
        self.space.wait_for(lambda: self.inflight_bytes == 0 or self.pending_error is not None or ready())
        waited = time.perf_counter() - t0
        self.stats.store_wait_seconds += waited
        self.raise_pending()
        return waited

    def _uncount(self, e: Entry) -> None:
        """The store of ``e`` is over (done, failed or cancelled): its bytes are no longer in flight."""
        if e.counted:
            e.counted = False
            self.inflight_bytes -= e.nbytes
            self.space.notify_all()

    def not_ahead(self, e: Entry) -> None:
        """``e`` was handed to autograd (or dropped): its prefetched bytes no longer count as ahead."""
        if e.ahead:
            e.ahead = False
            self.ahead_bytes -= e.nbytes

    # -------------------------------------------------------------- stores
    def submit_store(self, e: Entry) -> None:
        """Track ``e`` and queue its store (lock held)."""
        if e.device.type == "cuda":
            stream = torch.cuda.current_stream(e.device)
            e.pack_event = torch.cuda.Event()
            e.pack_event.record(stream)
            e.pack_stream = stream
        self.entries[e.sid] = e
        self.inflight_bytes += e.nbytes
        st = self.stats
        st.peak_inflight_bytes = max(st.peak_inflight_bytes, self.inflight_bytes)
        st.storages_offloaded += 1
        st.bytes_queued += e.nbytes
        self._worker(self.store_workers, e.store.kind, "store", 4).submit(
            functools.partial(self._store_job, e), fail=functools.partial(self._store_failed, e))

    def _store_job(self, e: Entry) -> Any:
        with self.lock:
            if e.state != PENDING or e.cancelled or e.released:
                return None
            e.state = STORING
            src, ready = e.src, e.pack_event
        try:
            assert src is not None
            streams = self.job_streams(e.device)
            res = e.store.write(e.slot, src, ready, streams, e.name, lambda: e.forwarded or e.released)
        except BaseException as exc:  # noqa: BLE001 - reported in the step, never swallowed
            self._store_failed(e, exc)
            return None
        del src
        with self.lock:  # the slot holds the written copy from now on: a failure later frees it
            e.slot.loc, e.slot.crc = res.loc, res.crc

        def finish() -> None:
            with self.lock:
                try:
                    if res.cleanup is not None:
                        res.cleanup()
                    self._finish_store(e, res, res.busy_seconds())
                except BaseException as exc:  # noqa: BLE001 - reported in the step, never swallowed
                    self._store_failed(e, exc)

        if res.event is not None:
            return res.event, finish  # waiting for it failed (a CUDA error): the worker calls _store_failed
        finish()
        return None

    def _finish_store(self, e: Entry, res: IOResult, secs: float) -> None:
        self._uncount(e)
        st = self.stats
        rec = e.record
        done = e.nbytes if res.complete else min(res.bytes_done, e.nbytes)
        if done:  # a store stopped early still measured the bandwidth with the bytes it wrote
            st.write_seconds += secs
            st.bytes_written_partial += 0 if res.complete else done
            rec.write_s += secs
            rec.bytes_written += done
        if res.complete:
            st.bytes_offloaded += e.nbytes
        if e.store.kind == "ssd":
            st.files_created += 1
            st.peak_disk_bytes = max(st.peak_disk_bytes, e.store.peak_in_use)
        else:
            st.peak_host_bytes = max(st.peak_host_bytes, e.store.peak_in_use)
        if e.tensor is not None and e.tensor._version != e.version:
            e.modified = True
        e.tensor = None
        if e.released:
            e.src = None
            self._free_slot(e)
            return
        if e.forwarded or not res.complete:
            e.gpu, e.src = e.src, None
            e.state = RESIDENT
            e.ready.set()
            self._free_slot(e)
            return
        e.src = None  # the device memory goes back to the allocator now
        e.state = STORED
        self.space.notify_all()  # waiters on the allocator's counters see the freed memory

    def _store_failed(self, e: Entry, exc: BaseException) -> None:
        """The store of ``e`` raised ``exc`` (anywhere: set-up, write, its copy, finishing): end it as failed."""
        err = exc if isinstance(exc, OffloadError) else OffloadError(
            f"storing an activation of {e.nbytes} bytes to {e.store.kind} failed: "
            f"{exc.__class__.__name__}: {exc}")
        if err is not exc:
            err.__cause__ = exc
        with self.lock:
            self._uncount(e)
            self.stats.store_errors += 1
            if e.state in (PENDING, STORING) and not e.cancelled:  # the store had not ended: undo it
                try:
                    if e.slot.loc is not None:  # written (or partly): the copy goes
                        self._free_slot(e)
                    else:
                        e.store.unreserve(e.slot)
                except BaseException as again:  # noqa: BLE001 - the store's own error is the one reported
                    log.warning("releasing the room of a failed store failed too: %s: %s",
                                again.__class__.__name__, again)
                e.tensor = None
                if e.released:  # autograd is done with the tensor (used from memory while this store ran) ...
                    e.src = None
                else:
                    e.gpu, e.src = e.src, None
                    e.state = RESIDENT
                    e.ready.set()
                    self.stats.bytes_kept_error += e.nbytes
            # ... the store failed all the same (a full disk fails the next ones too): reported either way, so the
            # outcome does not depend on whether the backward or the write finished first
            if self.on_error == "raise":
                if self.pending_error is None:
                    err.message = f"{err.message}; to keep training when a store fails, pass on_error='keep'"
                    self.pending_error = err
            else:
                log.warning("%s; %s (on_error='keep')", err,
                            "the tensor was used from memory" if e.released else "keeping the tensor in memory")

    def _free_slot(self, e: Entry) -> None:
        """Release the stored copy of ``e`` (lock held)."""
        if e.slot.loc is None:
            return
        if e.store.free(e.slot):
            self.stats.files_removed += 1

    def forward_pending(self, e: Entry) -> None:
        """Cancel the queued store of ``e``: its bytes stay in memory (lock held)."""
        self._uncount(e)
        e.cancelled = True
        e.forwarded = True
        e.store.unreserve(e.slot)
        e.gpu, e.src, e.tensor = e.src, None, None
        e.state = RESIDENT
        e.ready.set()
        self.stats.stores_cancelled += 1
        self.stats.bytes_forwarded += e.nbytes

    # --------------------------------------------------------------- loads
    def bring_back(self, e: Entry, prefetch: bool) -> None:
        """Start getting ``e`` back into device memory (lock held): cancel a pending store, forward a
        running one from memory, or load a stored one."""
        if e.state == PENDING:
            self.forward_pending(e)
        elif e.state == STORING and not e.forwarded:
            e.forwarded = True
            self.stats.bytes_forwarded += e.nbytes
        elif e.state == STORED:
            self._submit_load(e)
            if prefetch:
                self.stats.loads_prefetched += 1
                e.ahead = True
                self.ahead_bytes += e.nbytes
                self.stats.peak_prefetch_bytes = max(self.stats.peak_prefetch_bytes, self.ahead_bytes)
            else:
                self.stats.loads_on_demand += 1

    def _submit_load(self, e: Entry) -> None:
        """Allocate the destination on the current stream and queue the load of ``e`` (lock held)."""
        dst = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
        alloc_ev = None
        if dst.is_cuda:
            cur = torch.cuda.current_stream(e.device)
            alloc_ev = torch.cuda.Event()
            alloc_ev.record(cur)
            e.alloc_stream = cur
            dst.record_stream(self.streams_for(e.device).load)
        e.gpu = dst
        e.state = LOADING
        e.ready.clear()
        # loads are issued in the order the backward needs them; a small window would stall the
        # issuing of later loads on the completion of earlier ones (autograd then waits)
        self._worker(self.load_workers, e.store.kind, "load", 64).submit(
            functools.partial(self._load_job, e, alloc_ev), fail=functools.partial(self._load_failed, e))

    def _load_job(self, e: Entry, alloc_ev: Any) -> Any:
        with self.lock:
            if e.released or e.state != LOADING:
                if e.state == LOADING:
                    self._free_slot(e)
                    e.gpu = None
                    e.ready.set()
                return None
            dst = e.gpu
        try:
            assert dst is not None
            streams = self.job_streams(e.device)
            if e.slot.loc is None:
                raise OffloadError(f"offloaded storage {e.sid} has no stored copy to load")
            res = e.store.read(e.slot, dst, alloc_ev, streams, e.name)
        except BaseException as exc:  # noqa: BLE001 - raised where the tensor is unpacked
            self._load_failed(e, exc)
            return None
        del dst
        with self.lock:
            e.ready_event = res.event
            e.state = RESIDENT
            if res.cleanup is None:  # consumed: a file is gone now; a host block goes with the cleanup
                self._count_removed(e)
            if e.released:
                e.gpu = None
            e.ready.set()

        def finish() -> None:
            with self.lock:
                try:
                    secs = res.busy_seconds()
                    self.stats.read_seconds += secs
                    self.stats.bytes_loaded += e.nbytes
                    e.record.read_s += secs
                    e.record.bytes_read += e.nbytes
                    if res.cleanup is not None:
                        res.cleanup()
                except BaseException as exc:  # noqa: BLE001 - reported, never swallowed
                    self._load_failed(e, exc)

        if res.event is not None and (res.timing is not None or res.cleanup is not None):
            return res.event, finish  # waiting for it failed (a CUDA error): the worker calls _load_failed
        finish()
        return None

    def _load_failed(self, e: Entry, exc: BaseException) -> None:
        """The load of ``e`` raised ``exc`` (set-up, read, its copy, finishing): the entry fails, and its unpack
        raises; where autograd already has the bytes (the copy's end failed after they were handed over), the
        error is raised in the step instead (the bytes cannot be trusted)."""
        err = exc if isinstance(exc, OffloadError) else OffloadError(
            f"loading an activation of {e.nbytes} bytes from {e.store.kind} failed: "
            f"{exc.__class__.__name__}: {exc}")
        if err is not exc:
            err.__cause__ = exc
        err.__traceback__ = None  # kept in the entry: no frames (and no reference cycle through them)
        with self.lock:
            self.stats.load_errors += 1
            if e.state == LOADING or (e.state == RESIDENT and e.gpu is not None):  # not handed to autograd yet
                e.error = err
                e.state = FAILED
                e.gpu = None
                e.ready_event = None
                try:
                    self._free_slot(e)
                except BaseException as again:  # noqa: BLE001 - the load's own error is the one reported
                    log.warning("releasing the copy of a failed load failed too: %s: %s",
                                again.__class__.__name__, again)
                e.ready.set()
            elif e.state == RESIDENT and self.pending_error is None:  # autograd may have used the bytes
                self.pending_error = err
                self.space.notify_all()

    def _count_removed(self, e: Entry) -> None:
        if e.store.kind == "ssd":
            self.stats.files_removed += 1

    # ------------------------------------------------------------- unpack
    def acquire(self, e: Entry) -> torch.Tensor:
        """The bytes of ``e`` in device memory, usable on the current stream (waits for a load in flight).

        Called with the lock held, after `bring_back`; releases the lock while it waits.
        """
        forwarded = e.state == STORING or (e.state == RESIDENT and e.alloc_stream is None)
        if forwarded:
            data = e.src if e.state == STORING else e.data()
            assert data is not None
            if data.is_cuda:
                cur = torch.cuda.current_stream(data.device)
                if e.pack_stream is not None and e.pack_stream != cur:
                    cur.wait_event(e.pack_event)
                    data.record_stream(cur)
            return data
        t0 = time.perf_counter()
        self.lock.release()
        try:
            e.ready.wait()
        finally:
            self.lock.acquire()
        waited = time.perf_counter() - t0
        self.stats.unpack_wait_seconds += waited
        e.record.wait_s += waited
        if e.error is not None:
            raise fresh(e.error)
        data, ev, stream = e.data(), e.ready_event, e.alloc_stream
        assert data is not None, f"offloaded storage {e.sid} has no data in state {e.state}"
        if data.is_cuda:
            cur = torch.cuda.current_stream(data.device)
            if ev is not None:
                cur.wait_event(ev)
            if stream is not None and stream != cur:
                data.record_stream(cur)
        return data

    def release(self, e: Entry) -> None:
        """Autograd dropped the last handle of ``e`` (lock held): free what it holds."""
        e.released = True
        self.not_ahead(e)
        self.entries.pop(e.sid, None)
        if e.state == PENDING:
            self._uncount(e)
            e.cancelled = True
            e.store.unreserve(e.slot)
            e.src = e.tensor = None
            self.stats.stores_cancelled += 1
        elif e.state == STORED:
            self._free_slot(e)
        elif e.state in (RESIDENT, FAILED):
            e.gpu = e.src = None
        # STORING / LOADING: the worker frees what it holds when it finishes

    def shutdown(self, join: bool, timeout: float | None = None) -> None:
        for w in self.workers():
            w.stop(join=join, timeout=timeout)
