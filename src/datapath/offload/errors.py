"""Exceptions raised by `datapath.offload`."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class OffloadError(DatapathError, OSError):
    """An activation could not be stored or reloaded (full disk, I/O error, short write, missing file).

    Raised in the training step that needs the tensor (from a pack/unpack hook,
    `TensorCache.wait_io`, or the end of the ``offload`` context), never replaced
    by a wrong value.  ``errno`` and ``filename`` are set when the cause was an
    operating-system error.  To keep training when the *store* fails, build the
    cache with ``on_error="keep"``: the tensor then stays in memory instead.
    """

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.errno = errno
        self.filename = filename

    def __str__(self) -> str:
        return self.message


class OffloadConfigError(DatapathError, ValueError):
    """A `TensorCache` / ``offload`` argument is invalid (unknown target, bad budget, missing path)."""


class OffloadWarning(UserWarning):
    """Offloading did less than asked (a store with no room left): training goes on, the tensor stays in memory."""
