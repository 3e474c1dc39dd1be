"""File engines for the ssd target: a POSIX engine (thread pool, O_DIRECT where the filesystem
takes it) and a kvikio engine (cuFile: GPUDirect Storage when usable, its compatibility mode
otherwise).  Both write and read whole files of one storage each; errors come out as
`OffloadError` with the errno and the file name.
"""
from __future__ import annotations

import errno as _errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from datapath.offload._host_pool import ALIGN, aligned_empty, round_up
from datapath.offload.errors import OffloadError

log = logging.getLogger("datapath.offload.io")

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def os_error(exc: OSError, what: str, path: str) -> OffloadError:
    """An `OffloadError` for OS error ``exc`` raised while doing ``what`` on ``path``."""
    code = exc.errno
    if code == _errno.ENOSPC:
        hint = "the disk is full: free space or lower max_disk_bytes"
    elif code == _errno.EIO:
        hint = "the device reported an I/O error: check the disk (dmesg) or offload to another path"
    elif code == _errno.ENOENT:
        hint = "the activation file vanished: another process or a cleanup job deleted it; the step cannot continue"
    else:
        hint = "see the OS error"
    err = OffloadError(f"{what} {path} failed: [Errno {code}] {os.strerror(code) if code else exc}; {hint}",
                       errno=code, filename=path)
    err.__cause__ = exc
    return err


def probe_direct(directory: str) -> bool:
    """True when files in ``directory`` accept O_DIRECT (aligned) writes and reads."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, ".direct-probe")
    buf = aligned_empty(ALIGN, pinned=False)
    buf.fill_(7)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        mv = memoryview(buf.numpy())
        if os.pwrite(fd, mv, 0) != ALIGN:
            return False
        return os.preadv(fd, [mv], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


class Staging:
    """A fixed set of 4 KiB-aligned host buffers (pinned with CUDA) handed out one at a time."""

    def __init__(self, count: int, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self._free = [aligned_empty(nbytes, pinned=pinned) for _ in range(count)]
        self._cv = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._cv:
            while not self._free:
                self._cv.wait()
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


class PosixEngine:
    """Reads and writes files with ``pwrite``/``preadv`` from a thread pool, O_DIRECT when available.

    ``pwrite``/``preadv`` are the system calls used: instance attributes, so a test can
    inject ENOSPC/EIO/short writes into one engine.
    """

    name = "posix"

    def __init__(self, directory: str, threads: int = 4, chunk_bytes: int = 16 << 20,
                 direct: bool | None = None) -> None:
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}, got {chunk_bytes}")
        self.directory = directory
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self.direct = probe_direct(directory) if direct is None else (direct and bool(_O_DIRECT))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="datapath-io")
        self.pwrite = os.pwrite
        self.preadv = os.preadv
        log.info("POSIX offload engine in %s: %d threads, %d MiB chunks, O_DIRECT %s",
                 directory, threads, chunk_bytes >> 20, "on" if self.direct else "off (filesystem refuses it)")

    # file handles -----------------------------------------------------------
    def open_write(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (_O_DIRECT if self.direct else 0)
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            raise os_error(exc, "creating", path) from exc

    def open_read(self, path: str) -> int:
        flags = os.O_RDONLY | (_O_DIRECT if self.direct else 0)
        try:
            return os.open(path, flags)
        except OSError as exc:
            raise os_error(exc, "opening", path) from exc

    def padded(self, n: int) -> int:
        """Bytes actually transferred for ``n`` payload bytes (a multiple of 4 KiB under O_DIRECT)."""
        return round_up(n) if self.direct else n

    # chunk I/O (run in the pool) ---------------------------------------------
    def write_chunk(self, fd: int, buf: torch.Tensor, n: int, offset: int, path: str) -> None:
        """Write the first ``n`` bytes of host buffer ``buf`` at ``offset`` (padded under O_DIRECT)."""
        total = self.padded(n)
        mv = memoryview(buf[:total].numpy())
        done = 0
        try:
            while done < total:
                k = self.pwrite(fd, mv[done:], offset + done)
                if k <= 0:
                    raise OffloadError(
                        f"short write to {path}: {done} of {total} bytes at offset {offset} written, "
                        f"then the write returned {k}; the disk is probably full",
                        errno=_errno.ENOSPC, filename=path)
                done += k
        except OSError as exc:
            if isinstance(exc, OffloadError):
                raise
            raise os_error(exc, "writing", path) from exc

    def read_chunk(self, fd: int, buf: torch.Tensor, n: int, offset: int, path: str) -> None:
        """Read ``n`` payload bytes at ``offset`` into host buffer ``buf``."""
        total = self.padded(n)
        mv = memoryview(buf[:total].numpy())
        done = 0
        try:
            while done < n:
                k = self.preadv(fd, [mv[done:]], offset + done)
                if k <= 0:
                    raise OffloadError(
                        f"short read from {path}: the file ends after {offset + done} bytes but "
                        f"{offset + n} were written; it was truncated or replaced",
                        errno=_errno.EIO, filename=path)
                done += k
        except OSError as exc:
            if isinstance(exc, OffloadError):
                raise
            raise os_error(exc, "reading", path) from exc

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _kvikio() -> Any:
    import kvikio  # noqa: PLC0415 - optional, needs a CUDA driver

    return kvikio


def kvikio_usable(directory: str) -> str | None:
    """None when kvikio imports and can write/read a file in ``directory`` from GPU memory, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        kvikio = _kvikio()
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"kvikio does not import ({exc.__class__.__name__}: {exc})"
    path = os.path.join(directory, ".kvikio-probe")
    try:
        src = torch.arange(ALIGN, dtype=torch.int32, device="cuda").to(torch.uint8)
        dst = torch.empty_like(src)
        torch.cuda.synchronize()
        with kvikio.CuFile(path, "w") as f:
            if f.write(src) != src.numel():
                return "kvikio short write in probe"
        with kvikio.CuFile(path, "r") as f:
            if f.read(dst) != dst.numel():
                return "kvikio short read in probe"
        if not torch.equal(src, dst):
            return "kvikio probe read back different bytes"
    except Exception as exc:  # noqa: BLE001
        return f"kvikio probe failed ({exc.__class__.__name__}: {exc})"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


class KvikioEngine:
    """cuFile I/O straight between GPU memory and files (GPUDirect Storage when the system has it)."""

    name = "kvikio"

    def __init__(self) -> None:
        self.kvikio = _kvikio()
        try:
            self.gds = not bool(self.kvikio.defaults.is_compat_mode_preferred())
        except Exception:  # noqa: BLE001 - older/newer kvikio spell this differently
            self.gds = False
        log.info("kvikio offload engine (%s)", "GPUDirect Storage" if self.gds else "compatibility mode")

    def write(self, path: str, src: torch.Tensor) -> None:
        try:
            with self.kvikio.CuFile(path, "w") as f:
                n = f.write(src)
        except OSError as exc:
            raise os_error(exc, "writing", path) from exc
        except RuntimeError as exc:
            raise OffloadError(f"kvikio write to {path} failed: {exc}", filename=path) from exc
        if n != src.numel():
            raise OffloadError(f"short write to {path}: {n} of {src.numel()} bytes", errno=_errno.ENOSPC,
                               filename=path)

    def read(self, path: str, dst: torch.Tensor) -> None:
        if not os.path.exists(path):
            raise os_error(FileNotFoundError(_errno.ENOENT, "No such file or directory", path), "opening", path)
        try:
            with self.kvikio.CuFile(path, "r") as f:
                n = f.read(dst)
        except OSError as exc:
            raise os_error(exc, "reading", path) from exc
        except RuntimeError as exc:
            raise OffloadError(f"kvikio read from {path} failed: {exc}", filename=path) from exc
        if n != dst.numel():
            raise OffloadError(f"short read from {path}: {n} of {dst.numel()} bytes", errno=_errno.EIO,
                               filename=path)
