"""Making unified tensors from existing memory, and getting at their host side."""
from __future__ import annotations

import numpy as np
import torch

import logging

from datapath._runtime.pinned import HostRegisterError, pinnable_in_place, register_in_place
from datapath.unified_tensor.tensor import Affinity, UnifiedTensor, to_unified

log = logging.getLogger("datapath.unified_tensor.memory")
_CUDA_ERROR_INVALID_VALUE = 1


def as_unified(t: torch.Tensor | np.ndarray, affinity: Affinity = "host") -> UnifiedTensor:
    """The same memory as CPU tensor (or numpy array / memmap) ``t``, pinned in place, as a unified tensor.

    No copy is made: tables of tens of GB loaded with numpy become GPU-readable where
    they lie, and so do ``/dev/shm`` mappings (`share`/`attach`).  One exception: a
    mapping of a regular file on disk (``np.load(..., mmap_mode="r+")``) cannot be
    pinned by Linux, so it is copied once into pinned memory (logged).  The memory is unpinned when the last unified
    tensor made from it (views included) is freed.  Without CUDA nothing is pinned and
    the unified tensor simply shares ``t``'s memory.

    Raises:
        PinnedMemoryError: the range cannot be pinned (too large for this machine).
        ValueError: ``t`` is not in host memory.
    """
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    if isinstance(t, UnifiedTensor):
        return t if t.affinity == affinity else t.with_affinity(affinity)
    if t.device.type != "cpu":
        raise ValueError(f"as_unified pins host memory in place; got a tensor on {t.device} (use t.to('unified'))")
    if torch.cuda.is_available() and not pinnable_in_place(t):
        # A mapping of a file on a disk filesystem (np.load(..., mmap_mode=...)): Linux does not let devices
        # pin page-cache pages long-term.  The data must be resident to be read over PCIe anyway, so it is
        # copied once into pinned memory.
        log.warning("a disk-file mapping cannot be pinned in place; copying %.2f GiB into pinned memory",
                    t.numel() * t.element_size() / 2**30)
        return to_unified(t, affinity=affinity)
    try:
        handle = register_in_place(t)
    except HostRegisterError as exc:
        if exc.code != _CUDA_ERROR_INVALID_VALUE:
            raise
        log.warning("memory at %#x could not be pinned in place (%s); copying %.2f GiB into pinned memory",
                    t.data_ptr(), exc, t.numel() * t.element_size() / 2**30)
        return to_unified(t, affinity=affinity)
    return UnifiedTensor(t, affinity, (handle,) if handle is not None else ())


def is_unified(t: object) -> bool:
    """True for a tensor on the ``"unified"`` device."""
    return isinstance(t, UnifiedTensor)


def host_tensor(u: torch.Tensor) -> torch.Tensor:
    """The CPU tensor (pinned when CUDA is present) holding ``u``'s data: same memory, no copy."""
    if not isinstance(u, UnifiedTensor):
        raise TypeError(f"host_tensor needs a unified tensor, got one on {u.device}")
    return u._host


def set_affinity(u: torch.Tensor, affinity: Affinity) -> torch.Tensor:
    """Switch ``u``'s affinity in place (``"host"`` or ``"gpu"``); no data moves. Returns ``u``."""
    if not isinstance(u, UnifiedTensor):
        raise TypeError(f"set_affinity needs a unified tensor, got one on {u.device}")
    u.affinity = affinity
    return u
