"""Bounds checks of GPU row fetches that do not wait: `ErrorFlag`, `check_errors`.

A GPU gather or scatter never touches memory outside its table: an out-of-range index
makes the kernel write zeros into that output row (skip it, for a scatter) and store the
bad value in an error flag.  The flag is a word of pinned, GPU-mapped host memory, so the
host reads it without a CUDA call once the kernel has run.

Who reads the flag:

- a caller that passes its own `ErrorFlag` (the loader: one per batch, checked when the
  batch's event has completed, before the batch is handed over);
- otherwise the calling thread's flag: it is read at the start of the thread's next
  gather/scatter, and by `check_errors`; either raises ``IndexError`` naming the index.
  With ``sync=True`` (or ``gather_config.sync_bounds_check``) a call waits for its
  kernel and raises at once.
"""
from __future__ import annotations

import threading

import torch

from datapath._runtime.pinned import pinned_empty

NO_ERROR = -(2**63)


class ErrorFlag:
    """Where GPU fetches that do not wait record an out-of-range index.

    One flag may serve several launches; call `raise_if_set` after they are done (e.g.
    after waiting for an event recorded behind them).  ``host``: (2,) int64, pinned: the bad
    index and the row count of the table it was used on.
    """

    def __init__(self) -> None:
        self.host = pinned_empty((2,), torch.int64)
        self.host.fill_(NO_ERROR)
        self._word = self.host.numpy()  # reads without a torch op (the check runs before every fetch)
        self._ptr = self.host.data_ptr()

    @property
    def ptr(self) -> int:
        """The address a kernel writes to (host and device pointers agree under unified addressing)."""
        return self._ptr

    def is_set(self) -> bool:
        """True when a launch has recorded a bad index (reads host memory; no CUDA call)."""
        return int(self._word[0]) != NO_ERROR

    def raise_if_set(self, context: str = "") -> None:
        """Raise ``IndexError`` if a finished launch saw an out-of-range index (the caller waited for it).

        The flag is cleared first, so each bad index is reported once.
        """
        bad, size = int(self._word[0]), int(self._word[1])
        if bad == NO_ERROR:
            return
        self._word[0] = NO_ERROR
        raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {size}{context}")


class _ThreadFlags(threading.local):
    """Each thread's flag for launches without a caller's flag (made on first use)."""

    flag: ErrorFlag | None = None


_local = _ThreadFlags()
_all_lock = threading.Lock()
_all: list[ErrorFlag] = []


def thread_flag() -> ErrorFlag:
    """This thread's deferred-check flag."""
    flag = _local.flag
    if flag is None:
        flag = _local.flag = ErrorFlag()
        with _all_lock:
            _all.append(flag)
    return flag


def current_flag() -> ErrorFlag | None:
    """This thread's flag if it has made one (nothing checked or made: a launcher that reads the word itself)."""
    return _local.flag


_DEFERRED = (" (found by an earlier GPU gather/scatter of this thread that did not wait for its bounds check; "
             "the rows it returned for that index are zeros)")


def raise_deferred() -> None:
    """Raise the ``IndexError`` an earlier call of this thread recorded (called at the start of each fetch)."""
    flag = _local.flag
    if flag is not None and flag.is_set():
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # let every launch that may write it finish: one report per error
        flag.raise_if_set(_DEFERRED)


def deferred_flag() -> ErrorFlag:
    """For a fetch made of several launches: raise this thread's earlier error, then its flag for all of them."""
    flag = _local.flag
    if flag is None:
        return thread_flag()
    if flag.is_set():
        raise_deferred()
    return flag


def check_errors() -> None:
    """Wait for the GPU and raise ``IndexError`` for an out-of-range index seen by any earlier call.

    Covers the fetches that did not wait (the default) of every thread that did not
    pass its own `ErrorFlag`.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with _all_lock:
        flags = list(_all)
    for flag in flags:
        flag.raise_if_set(_DEFERRED)
