"""The host-backed record: the host buffer a table lives in, whether it may be written, and its device view.

`HostRecord` is what `datapath.unified_tensor.UnifiedTensor` is built on (``class
UnifiedTensor(torch.Tensor, HostRecord)``): the memory layer owns the record and answers every
question about it (`datapath.memory.is_unified`, `is_read_only`, `host_of`, `kernel_view`, the
row fetch), so nothing below `unified_tensor` ever imports it.

    rec.host            # (N, *rest) CPU tensor: pinned and GPU-mapped where CUDA is present
    rec.read_only       # True over read-only memory (np.load(..., mmap_mode="r")): writes raise
    rec.device_view()   # a CUDA tensor over the same memory (zero copy), for a GPU kernel
    rec.host_array()    # a numpy array over the same memory, not writeable when read_only
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from datapath._runtime.errors import DatapathError
from datapath._runtime.pinned import cuda_alias


class ReadOnlyTableError(DatapathError):
    """A write into a table whose memory is read-only (a read-only mapping or a non-writable array)."""


class HostRecord:
    """Host memory a GPU kernel reads in place: the buffer, its read-only flag, what keeps it pinned.

    A mixin of no state of its own beyond three fields, set by the type built on it:

    - ``_host``: (N, *rest) CPU tensor holding the data (pinned and mapped when CUDA is present);
    - ``_readonly``: the memory is read-only (writing it would fault): every write path refuses;
    - ``_keep``: objects that keep the memory pinned (a `HostRegistration`), dropped with the record.
    """

    _host: torch.Tensor
    _readonly: bool
    _keep: tuple[Any, ...]

    @property
    def host(self) -> torch.Tensor:
        """The CPU tensor holding the data: same memory, no copy.  Do not write it when `read_only`."""
        return self._host

    @property
    def read_only(self) -> bool:
        """True when the memory is read-only (writes raise `ReadOnlyTableError`)."""
        return self._readonly

    def device_view(self) -> torch.Tensor:
        """A CUDA tensor over the same (pinned) memory, zero copy; `cuda_alias` raises where it is not pinned."""
        return cuda_alias(self._host)

    def host_array(self, force: bool = False) -> np.ndarray:
        """A numpy array over the same memory (``Tensor.numpy``), with ``writeable=False`` when `read_only`:
        a write into a read-only mapping through it raises ``ValueError`` instead of crashing the process."""
        a = self._host.numpy(force=force)
        if self._readonly:
            a.flags.writeable = False
        return a

    def refuse_write(self, what: str) -> None:
        """Raise `ReadOnlyTableError` naming ``what`` when the record is read-only."""
        if self._readonly:
            raise ReadOnlyTableError(
                f"{what} would write a read-only unified tensor (made from a read-only memory mapping or a numpy "
                f"array that is not writeable); copy it first with t.to('unified'), or load the array writable "
                f"(np.load without mmap_mode='r')")
