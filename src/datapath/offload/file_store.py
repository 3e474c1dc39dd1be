"""`FileStore`: one file per offloaded storage in a private directory, through kvikio or the POSIX engine.

Writes go through pinned staging buffers in chunks (O_DIRECT when the filesystem
takes it), several chunks in flight; a write can stop between chunks when its
tensor is needed again first.  Reads stage the chunks back the same way.  The
directory is private to the process (mode 0700) and removed at close, at exit and
on SIGTERM (`datapath.offload.spill_dir`).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from datapath.offload._host_pool import round_up
from datapath.offload._io_engine import KvikioEngine, PosixEngine, Staging, kvikio_usable
from datapath.offload.errors import OffloadConfigError, OffloadError
from datapath.offload.spill_dir import SpillDir
from datapath.offload.store import IOResult, Slot, Store, Streams, crc32

log = logging.getLogger("datapath.offload.file_store")

ENGINES = ("auto", "kvikio", "posix")


class FileStore(Store):
    """Files under ``base`` (a private subdirectory is made in it), at most ``max_disk_bytes`` at once."""

    kind = "ssd"

    def __init__(self, base: str, *, engine: str = "auto", threads: int = 4, chunk_bytes: int = 16 << 20,
                 max_disk_bytes: int | None = None, verify: bool = False) -> None:
        if engine not in ENGINES:
            raise OffloadConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.spill = SpillDir(base)
        self.verify = verify
        self.posix = PosixEngine(str(self.spill.path), threads=threads, chunk_bytes=chunk_bytes)
        self.kvikio: KvikioEngine | None = None
        if engine in ("auto", "kvikio"):
            why = kvikio_usable(str(self.spill.path))
            if why is None:
                kv = KvikioEngine()
                if engine == "kvikio" or kv.gds:
                    self.kvikio = kv
                else:
                    # without GPUDirect Storage kvikio bounces through host memory in its compatibility
                    # mode; the POSIX engine does the same with O_DIRECT, pinned staging and a thread pool
                    log.info("kvikio without GPUDirect Storage (compatibility mode): using the POSIX engine; "
                             "engine='kvikio' forces kvikio")
            elif engine == "kvikio":
                self.spill.remove()
                raise OffloadError(f"engine='kvikio' was asked for but kvikio is not usable: {why}. "
                                   f"Install kvikio (pip install kvikio-cu13) or use engine='posix'.")
            else:
                log.info("kvikio not used (%s); POSIX engine", why)
        self.engine_name = self.kvikio.name if self.kvikio is not None else self.posix.name
        self.free_bytes = shutil.disk_usage(self.spill.path).free
        self.max_disk_bytes = int(max_disk_bytes) if max_disk_bytes is not None else int(self.free_bytes * 0.9)
        depth = max(2, 2 * threads)
        pinned = torch.cuda.is_available()
        self._store_staging = Staging(depth, chunk_bytes, pinned)
        self._load_staging = Staging(depth, chunk_bytes, pinned)
        self.reserved = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        """Whether the POSIX engine uses O_DIRECT."""
        return self.posix.direct

    # room --------------------------------------------------------------------
    def reserve(self, nbytes: int) -> Slot | None:
        size = round_up(nbytes)
        with self._lock:
            if self.reserved + size > self.max_disk_bytes:
                return None
            self.reserved += size
            self._peak = max(self._peak, self.reserved)
        return Slot(self, nbytes)

    def unreserve(self, slot: Slot) -> None:
        with self._lock:
            self.reserved -= round_up(slot.nbytes)

    def room(self) -> int | None:
        return max(0, self.max_disk_bytes - self.reserved)

    def free(self, slot: Slot) -> bool:
        path, slot.loc = slot.loc, None
        removed = self._unlink(path) if path is not None else False
        self.unreserve(slot)
        return removed

    @property
    def in_use(self) -> int:
        return self.reserved

    @property
    def peak_in_use(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.reserved

    # write -------------------------------------------------------------------
    def write(self, slot: Slot, src: torch.Tensor, ready: Any, streams: Streams | None, name: str,
              abort: Callable[[], bool]) -> IOResult:
        path = self.spill.file(name)
        t0 = time.perf_counter()
        if self.kvikio is not None and src.is_cuda:
            if ready is not None:
                ready.synchronize()
            t0 = time.perf_counter()
            try:
                self.kvikio.write(path, src)
            except BaseException:
                self._unlink(path)
                raise
            return IOResult(loc=path, seconds=time.perf_counter() - t0, bytes_done=src.numel())
        eng = self.posix
        n = src.numel()
        fd = eng.open_write(path)
        futures = []
        crc: list[int] = []
        chunks = range(0, n, eng.chunk_bytes)
        complete = True
        try:
            if src.is_cuda and ready is not None:
                assert streams is not None
                streams.store.wait_event(ready)
            crc = [0] * len(chunks)
            for ci, off in enumerate(chunks):
                if abort():
                    complete = False
                    break
                k = min(eng.chunk_bytes, n - off)
                buf = self._store_staging.acquire()
                ev = None
                try:
                    if src.is_cuda:
                        assert streams is not None
                        with torch.cuda.stream(streams.store):
                            buf[:k].copy_(src[off: off + k], non_blocking=True)
                            ev = torch.cuda.Event()
                            ev.record(streams.store)
                    else:
                        buf[:k].copy_(src[off: off + k])
                    if eng.direct and k % 4096:
                        buf[k: round_up(k)].zero_()
                except BaseException:
                    self._store_staging.release(buf)
                    raise
                futures.append(eng.submit(self._write_chunk, fd, buf, k, off, path, ev, crc, ci))
            err = None
            for f in futures:
                e = f.exception()
                if e is not None and err is None:
                    err = e
            if err is not None:
                raise err
        except BaseException:
            for f in futures:
                f.exception()
            os.close(fd)
            self._unlink(path)
            raise
        os.close(fd)
        written = n if complete else sum(min(eng.chunk_bytes, n - off) for off in chunks[:len(futures)])
        return IOResult(loc=path, seconds=time.perf_counter() - t0, crc=crc if self.verify else [],
                        complete=complete, bytes_done=written)

    def _write_chunk(self, fd: int, buf: torch.Tensor, k: int, off: int, path: str, ev: Any,
                     crc: list[int], ci: int) -> None:
        try:
            if ev is not None:
                ev.synchronize()
            if self.verify:
                crc[ci] = crc32(buf[:k])
            self.posix.write_chunk(fd, buf, k, off, path)
        finally:
            self._store_staging.release(buf)

    # read --------------------------------------------------------------------
    def read(self, slot: Slot, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             name: str) -> IOResult:
        try:
            return self._read(slot.loc, dst, alloc_event, streams, slot.crc)
        finally:
            self.free(slot)  # consumed (or unreadable): the file goes now

    def _read(self, path: str, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
              crc: list[int]) -> IOResult:
        if path is None:
            raise OffloadError("an offloaded storage has no file to read back")
        t0 = time.perf_counter()
        if self.kvikio is not None and dst.is_cuda:
            if alloc_event is not None:
                alloc_event.synchronize()
            t0 = time.perf_counter()
            self.kvikio.read(path, dst)
            ev = torch.cuda.Event()
            assert streams is not None
            ev.record(streams.load)
            return IOResult(event=ev, seconds=time.perf_counter() - t0)
        eng = self.posix
        n = dst.numel()
        fd = eng.open_read(path)
        last_ev = None
        try:
            if dst.is_cuda and alloc_event is not None:
                assert streams is not None
                streams.load.wait_event(alloc_event)
            chunks = list(range(0, n, eng.chunk_bytes))
            depth = max(1, eng.threads)
            pending: list[Any] = []
            nxt = 0
            try:
                for ci, off in enumerate(chunks):
                    while nxt < len(chunks) and nxt < ci + depth:
                        o = chunks[nxt]
                        pending.append(eng.submit(self._read_chunk, fd, min(eng.chunk_bytes, n - o), o, path))
                        nxt += 1
                    buf = pending.pop(0).result()
                    k = min(eng.chunk_bytes, n - off)
                    try:
                        if self.verify and crc and crc32(buf[:k]) != crc[ci]:
                            raise OffloadError(
                                f"checksum mismatch in {path} at bytes {off}..{off + k}: the file was changed "
                                f"or the disk returned wrong data; the step cannot continue", filename=path)
                        if dst.is_cuda:
                            assert streams is not None
                            with torch.cuda.stream(streams.load):
                                dst[off: off + k].copy_(buf[:k], non_blocking=True)
                                last_ev = torch.cuda.Event()
                                last_ev.record(streams.load)
                            last_ev.synchronize()  # the staging buffer is reused next
                        else:
                            dst[off: off + k].copy_(buf[:k])
                    finally:
                        self._load_staging.release(buf)
            finally:
                for f in pending:  # drain reads still in flight after an error
                    try:
                        self._load_staging.release(f.result())
                    except BaseException:  # noqa: BLE001
                        pass
        finally:
            os.close(fd)
        return IOResult(event=last_ev, seconds=time.perf_counter() - t0)

    def _read_chunk(self, fd: int, k: int, off: int, path: str) -> torch.Tensor:
        buf = self._load_staging.acquire()
        try:
            self.posix.read_chunk(fd, buf, k, off, path)
        except BaseException:
            self._load_staging.release(buf)
            raise
        return buf

    # files -------------------------------------------------------------------
    @staticmethod
    def _unlink(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("could not delete %s: %s", path, exc)
            return False

    def where_full(self) -> str:
        return (f"the disk at {self.spill.base} (max_disk_bytes={self.max_disk_bytes / 1e9:.3g} GB, "
                f"{self.free_bytes / 1e9:.3g} GB free when the cache was made)")

    def files(self) -> list[str]:
        try:
            return sorted(os.listdir(self.spill.path))
        except FileNotFoundError:
            return []

    def close(self) -> None:
        self.posix.close()
        self.spill.remove()
