"""Where offloaded storages go: pinned host memory, files, or host memory then files.

A target moves the bytes of one storage (a 1-D ``uint8`` tensor on the GPU, or on
the CPU when CPU tensors are offloaded) out and back in.  On CUDA the copies run
on the cache's own store/load streams: a store first waits for the event
recorded when the tensor was packed (so it reads finished data), a load first
waits for the event recorded when its destination was allocated (so it never
writes memory a kernel still uses), and each returns the event that marks its
end.  Without CUDA every copy is a plain synchronous memcpy in the worker thread.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from datapath.offload._host_pool import HostBlock, HostPool, round_up
from datapath.offload._io_engine import KvikioEngine, PosixEngine, Staging, os_error
from datapath.offload._spill_dir import SpillDir
from datapath.offload.errors import OffloadError

log = logging.getLogger("datapath.offload.targets")


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.numpy()))


@dataclass
class IOResult:
    """Outcome of one store or load job."""

    loc: Any = None                                  # HostBlock or file path (stores)
    event: Any = None                                # CUDA event ending the copy (None: done on return)
    timing: tuple[Any, Any] | None = None            # CUDA events around the copy, for busy time
    seconds: float = 0.0                             # host-measured busy time when timing is None
    crc: list[int] = field(default_factory=list)     # chunk checksums (verify=True)
    cleanup: Any = None                              # callable to run once ``event`` completed
    complete: bool = True                            # False: a store stopped early (tensor forwarded)
    bytes_done: int = 0                              # bytes a store stopped early did write


class Streams:
    """The store and load CUDA streams of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.store = torch.cuda.Stream(device)
        self.load = torch.cuda.Stream(device)


class HostTarget:
    """Offload to pinned host memory from a `HostPool` (size found by the first step, then reused)."""

    kind = "host"

    def __init__(self, pool: HostPool, verify: bool = False) -> None:
        self.pool = pool
        self.verify = verify

    def reserve(self, nbytes: int) -> bool:
        return self.pool.try_reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self.pool.unreserve(nbytes)

    def store(self, src: torch.Tensor, pack_event: Any, streams: Streams | None) -> IOResult:
        block = self.pool.alloc(src.numel())
        if src.is_cuda:
            assert streams is not None
            s = streams.store
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                if pack_event is not None:
                    s.wait_event(pack_event)
                start.record(s)
                block.data.copy_(src, non_blocking=True)
                end.record(s)
            res = IOResult(loc=block, event=end, timing=(start, end))
            if self.verify:
                res.cleanup = lambda: res.crc.append(_crc(block.data))
            return res
        t0 = time.perf_counter()
        block.data.copy_(src)
        res = IOResult(loc=block, seconds=time.perf_counter() - t0)
        if self.verify:
            res.crc.append(_crc(block.data))
        return res

    def load(self, loc: HostBlock, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             crc: list[int], name: str) -> IOResult:
        if self.verify and crc and _crc(loc.data) != crc[0]:
            raise OffloadError(f"checksum mismatch reloading {name} from host memory: the pinned copy was "
                               f"overwritten; this is a bug, please report it")
        if dst.is_cuda:
            assert streams is not None
            s = streams.load
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                if alloc_event is not None:
                    s.wait_event(alloc_event)
                start.record(s)
                dst.copy_(loc.data, non_blocking=True)
                end.record(s)
            return IOResult(event=end, timing=(start, end), cleanup=lambda: self.pool.free(loc))
        t0 = time.perf_counter()
        dst.copy_(loc.data)
        self.pool.free(loc)
        return IOResult(seconds=time.perf_counter() - t0)

    def free(self, loc: HostBlock) -> None:
        self.pool.free(loc)

    def close(self) -> None:
        self.pool.clear()


class SsdTarget:
    """Offload to one file per storage in a private directory, through kvikio or the POSIX engine."""

    kind = "ssd"

    def __init__(self, spill: SpillDir, *, engine: str = "auto", threads: int = 4, chunk_bytes: int = 16 << 20,
                 max_disk_bytes: int | None = None, verify: bool = False) -> None:
        from datapath.offload._io_engine import kvikio_usable  # noqa: PLC0415

        self.spill = spill
        self.verify = verify
        self.posix = PosixEngine(str(spill.path), threads=threads, chunk_bytes=chunk_bytes)
        self.kvikio: KvikioEngine | None = None
        if engine in ("auto", "kvikio"):
            why = kvikio_usable(str(spill.path))
            if why is None:
                kv = KvikioEngine()
                if engine == "kvikio" or kv.gds:
                    self.kvikio = kv
                else:
                    # without GPUDirect Storage kvikio bounces through host memory in its compatibility
                    # mode; the POSIX engine does the same with O_DIRECT, pinned staging and a thread pool
                    # (on the GPU machine: 2.2 GB/s against 0.09 GB/s for kvikio's compatibility mode)
                    log.info("kvikio without GPUDirect Storage (compatibility mode): using the POSIX engine; "
                             "engine='kvikio' forces kvikio")
            elif engine == "kvikio":
                raise OffloadError(f"engine='kvikio' was asked for but kvikio is not usable: {why}. "
                                   f"Install kvikio (pip install kvikio-cu13) or use engine='posix'.")
            else:
                log.info("kvikio not used (%s); POSIX engine", why)
        elif engine != "posix":
            raise ValueError(f"engine must be 'auto', 'kvikio' or 'posix', got {engine!r}")
        self.engine_name = self.kvikio.name if self.kvikio is not None else self.posix.name
        free = shutil.disk_usage(spill.path).free
        self.max_disk_bytes = int(max_disk_bytes) if max_disk_bytes is not None else int(free * 0.9)
        depth = max(2, 2 * threads)
        pinned = torch.cuda.is_available()
        self._store_staging = Staging(depth, chunk_bytes, pinned)
        self._load_staging = Staging(depth, chunk_bytes, pinned)
        self.reserved = 0
        self.peak_reserved = 0
        import threading  # noqa: PLC0415

        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        return self.posix.direct

    def reserve(self, nbytes: int) -> bool:
        size = round_up(nbytes)
        with self._lock:
            if self.reserved + size > self.max_disk_bytes:
                return False
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= round_up(nbytes)

    def probe(self, nbytes: int, streams: Streams | None) -> tuple[float, float]:
        """Write then read ``nbytes`` through this target's engine; (write, read) bytes/s.

        From GPU memory when ``streams`` is given (the path activations take), else from host memory.
        """
        device = streams.device if streams is not None else torch.device("cpu")
        # a private generator: the probe runs inside a training step and must not move the global RNG
        # (dropout masks of the step would change)
        gen = torch.Generator(device=device).manual_seed(nbytes)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        dst = torch.empty_like(src)
        name = f"probe-{os.getpid()}.tmp"
        if not self.reserve(nbytes):
            raise OffloadError(f"no room for a {nbytes}-byte disk probe under max_disk_bytes={self.max_disk_bytes}")
        try:
            if src.is_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            res = self.store(src, None, streams, name, lambda: False)
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self.load(res.loc, dst, None, streams, [], name)
            if out.event is not None:
                out.event.synchronize()
            tr = time.perf_counter() - t0
            if not torch.equal(src, dst):
                raise OffloadError(f"the disk probe in {self.spill.path} read back different bytes")
            return nbytes / tw, nbytes / tr
        finally:
            self._unlink(self.spill.file(name))
            self.unreserve(nbytes)

    # store -----------------------------------------------------------------
    def store(self, src: torch.Tensor, pack_event: Any, streams: Streams | None, name: str,
              abort: Any) -> IOResult:
        """Write ``src`` to file ``name``; ``abort()`` True stops between chunks (tensor forwarded)."""
        path = self.spill.file(name)
        t0 = time.perf_counter()
        if self.kvikio is not None and src.is_cuda:
            if pack_event is not None:
                pack_event.synchronize()
            t0 = time.perf_counter()
            try:
                self.kvikio.write(path, src)
            except BaseException:
                self._unlink(path)
                raise
            return IOResult(loc=path, seconds=time.perf_counter() - t0)
        eng = self.posix
        n = src.numel()
        fd = eng.open_write(path)
        futures = []
        crc: list[int] = []
        try:
            if src.is_cuda and pack_event is not None:
                assert streams is not None
                streams.store.wait_event(pack_event)
            chunks = range(0, n, eng.chunk_bytes)
            crc = [0] * len(chunks)
            complete = True
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
                futures.append(eng.submit(self._write_job, fd, buf, k, off, path, ev, crc, ci))
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

    def _write_job(self, fd: int, buf: torch.Tensor, k: int, off: int, path: str, ev: Any,
                   crc: list[int], ci: int) -> None:
        try:
            if ev is not None:
                ev.synchronize()
            if self.verify:
                crc[ci] = _crc(buf[:k])
            self.posix.write_chunk(fd, buf, k, off, path)
        finally:
            self._store_staging.release(buf)

    # load ------------------------------------------------------------------
    def load(self, path: str, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             crc: list[int], name: str) -> IOResult:
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
                        pending.append(eng.submit(self._read_job, fd, min(eng.chunk_bytes, n - o), o, path))
                        nxt += 1
                    buf = pending.pop(0).result()
                    k = min(eng.chunk_bytes, n - off)
                    try:
                        if self.verify and crc and _crc(buf[:k]) != crc[ci]:
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

    def _read_job(self, fd: int, k: int, off: int, path: str) -> torch.Tensor:
        buf = self._load_staging.acquire()
        try:
            self.posix.read_chunk(fd, buf, k, off, path)
        except BaseException:
            self._load_staging.release(buf)
            raise
        return buf

    def free(self, path: str) -> bool:
        """Delete the file of a consumed or released storage; True when a file was removed."""
        return self._unlink(path)

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

    def files(self) -> list[str]:
        try:
            return sorted(os.listdir(self.spill.path))
        except FileNotFoundError:
            return []

    def close(self) -> None:
        self.posix.close()
        self.spill.remove()


def missing_file_error(path: str) -> OffloadError:
    return os_error(FileNotFoundError(2, "No such file or directory", path), "opening", path)
