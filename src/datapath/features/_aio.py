"""Linux native asynchronous I/O (``io_submit``/``io_getevents``) through ctypes: many reads in flight from Python.

With O_DIRECT, the kernel queues every submitted read to the device at once, so one
thread keeps a queue of hundreds of 4 KiB reads in flight with a system call per batch
of them (what ``fio --ioengine=libaio --iodepth=N`` does).  The request blocks (iocbs)
are built for a whole batch at once in a numpy structured array.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import os
import platform

import numpy as np

# (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0

IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and EVENT.itemsize == 32


class AioError(OSError):
    """A failed read: ``offset`` is the file offset of the read, ``errno`` its error (None for a short read)."""

    def __init__(self, message: str, offset: int, code: int | None) -> None:
        super().__init__(message)
        self.offset = offset
        self.code = code

    def __str__(self) -> str:
        return self.args[0]


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


def available() -> str | None:
    """None when native AIO works here, else the reason (an unknown architecture, a kernel without it)."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"no io_submit numbers for {platform.machine()}"
    try:
        ctx = AioContext(1)
    except OSError as exc:
        return f"io_setup failed ({exc})"
    ctx.close()
    return None


class AioContext:
    """One ``io_setup`` context of ``depth`` slots; `read` runs batches of reads through it."""

    def __init__(self, depth: int) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None:
            raise OSError(_errno.ENOSYS, f"native AIO numbers unknown for {platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._lib = _libc()
        self.depth = int(depth)
        ctx = ctypes.c_ulong(0)
        if self._lib.syscall(ctypes.c_long(self._setup), ctypes.c_long(self.depth), ctypes.byref(ctx)) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup({self.depth}): {os.strerror(code)}")
        self._ctx = ctx.value
        self._events = np.zeros(self.depth, EVENT)

    def close(self) -> None:
        if self._ctx:
            self._lib.syscall(ctypes.c_long(self._destroy), ctypes.c_ulong(self._ctx))
            self._ctx = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def read(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray,
             expected: np.ndarray) -> None:
        """Read ``lengths[i]`` bytes at file offset ``offsets[i]`` into address ``addrs[i]``, all of them.

        ``expected[i]``: bytes the read must return (less than ``lengths[i]`` only at the end of
        the file).  Raises `AioError` naming the offset of the first read that failed or came
        back short; the others in flight are reaped first.
        """
        n = int(offsets.size)
        if n == 0:
            return
        iocbs = np.zeros(n, IOCB)
        iocbs["data"] = np.arange(n, dtype=np.uint64)
        iocbs["opcode"] = _IOCB_CMD_PREAD
        iocbs["fildes"] = fd
        iocbs["buf"] = addrs
        iocbs["nbytes"] = lengths
        iocbs["offset"] = offsets
        ptrs = (np.uint64(iocbs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(IOCB.itemsize))
        ptr_base = ptrs.ctypes.data
        submitted = inflight = done = 0
        failure: AioError | None = None
        while done < submitted or (submitted < n and failure is None):
            if submitted < n and failure is None and inflight < self.depth:
                k = min(self.depth - inflight, n - submitted)
                rc = self._lib.syscall(ctypes.c_long(self._submit), ctypes.c_ulong(self._ctx), ctypes.c_long(k),
                                       ctypes.c_void_p(ptr_base + submitted * 8))
                if rc < 0:
                    code = ctypes.get_errno()
                    if code not in (_errno.EAGAIN, _errno.EINTR) or inflight == 0 and code != _errno.EINTR:
                        failure = AioError(f"io_submit failed: [Errno {code}] {os.strerror(code)}",
                                           int(offsets[submitted]), code)
                        continue
                else:
                    submitted += rc
                    inflight += rc
            if inflight == 0:
                continue
            got = self._lib.syscall(ctypes.c_long(self._getevents), ctypes.c_ulong(self._ctx), ctypes.c_long(1),
                                    ctypes.c_long(self.depth), ctypes.c_void_p(self._events.ctypes.data),
                                    ctypes.c_void_p(0))
            if got < 0:
                code = ctypes.get_errno()
                if code == _errno.EINTR:
                    continue
                raise AioError(f"io_getevents failed: [Errno {code}] {os.strerror(code)}", -1, code)
            ev = self._events[:got]
            inflight -= got
            done += got
            if failure is None:
                which = ev["data"].astype(np.int64)
                res = ev["res"]
                bad = np.flatnonzero(res != expected[which])
                if bad.size:
                    j = int(which[bad[0]])
                    r = int(res[bad[0]])
                    if r < 0:
                        failure = AioError(f"[Errno {-r}] {os.strerror(-r)}", int(offsets[j]), -r)
                    else:
                        failure = AioError(f"short read: {r} of {int(expected[j])} bytes", int(offsets[j]), None)
        if failure is not None:
            raise failure
