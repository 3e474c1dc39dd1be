"""Making unified tensors from existing memory, and getting at their host side."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from datapath._runtime.pinned import HostRegisterError, pinnable_in_place, register_in_place
from datapath.memory import ReadOnlyTableError
from datapath.memory.placement import is_read_only
from datapath.memory.placement import is_unified as is_unified  # noqa: F401 - the one answer, re-exported here
from datapath.unified_tensor.tensor import Affinity, UnifiedTensor, to_unified

log = logging.getLogger("datapath.unified_tensor.memory")
_CUDA_ERROR_INVALID_VALUE = 1


def _from_numpy(a: np.ndarray) -> tuple[torch.Tensor, bool]:
    """(a tensor over ``a``'s memory, whether that memory may not be written)."""
    readonly = not a.flags.writeable
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a), readonly


def _copy(t: torch.Tensor, affinity: Affinity, readonly: bool, why: str) -> UnifiedTensor:
    log.warning("%s; copying %.2f GiB into pinned memory", why, t.numel() * t.element_size() / 2**30)
    u = to_unified(t, affinity=affinity)
    u._readonly = readonly  # a copy of a read-only source stays read-only: writes would not reach the source
    return u


def as_unified(t: torch.Tensor | np.ndarray, affinity: Affinity = "host") -> UnifiedTensor:
    """The same memory as CPU tensor (or numpy array / memmap) ``t``, pinned in place, as a unified tensor.

    No copy is made: tables of tens of GB loaded with numpy become GPU-readable where
    they lie, and so do ``/dev/shm`` mappings (`share`/`attach`).  Read-only memory
    (``np.load(path, mmap_mode="r")``, an array with ``writeable=False``) gives a
    read-only unified tensor: reads work as for any other, every write raises
    `datapath.memory.ReadOnlyTableError`; it is pinned for GPU reads only, which Linux
    allows for a read-only mapping of a file on disk.  A writable mapping of a file on
    disk (``mmap_mode="r+"``/``"c"``) cannot be pinned by Linux, so it is copied once into
    pinned memory (logged); so is a read-only one where the driver refuses the read-only
    registration.  The memory is unpinned when the last unified tensor made from it
    (views included) is freed.  Without CUDA nothing is pinned and the unified tensor
    simply shares ``t``'s memory.

    Raises:
        PinnedMemoryError: the range cannot be pinned (too large for this machine).
        ValueError: ``t`` is not in host memory.
    """
    readonly = False
    if isinstance(t, np.ndarray):
        t, readonly = _from_numpy(t)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"as_unified(t) takes a CPU torch.Tensor or a numpy array (a np.memmap too), got "
                        f"{type(t).__name__}; wrap it first: as_unified(torch.tensor(...)) or as_unified(np.asarray(...))")
    if isinstance(t, UnifiedTensor):
        return t if t.affinity == affinity else t.with_affinity(affinity)
    if t.device.type != "cpu":
        raise ValueError(f"as_unified pins host memory in place; got a tensor on {t.device} (use t.to('unified'))")
    readonly = readonly or is_read_only(t)
    if not torch.cuda.is_available():
        return UnifiedTensor(t, affinity, (), readonly)
    if not readonly and not t.is_pinned() and not pinnable_in_place(t):
        # A writable mapping of a file on a disk filesystem: Linux does not let devices pin page-cache pages
        # long-term for writing.  The data must be resident to be read over PCIe anyway: copied once.
        return _copy(t, affinity, readonly, "a writable disk-file mapping cannot be pinned in place")
    try:
        handle = register_in_place(t, read_only=readonly)
    except HostRegisterError as exc:
        if exc.code != _CUDA_ERROR_INVALID_VALUE and not readonly:
            raise
        return _copy(t, affinity, readonly, f"memory at {t.data_ptr():#x} could not be pinned in place ({exc})")
    return UnifiedTensor(t, affinity, (handle,) if handle is not None else (), readonly)


def host_tensor(u: torch.Tensor) -> torch.Tensor:
    """The CPU tensor (pinned when CUDA is present) holding ``u``'s data: same memory, no copy.

    Raises:
        ReadOnlyTableError: ``u`` is read-only (a tensor has no read-only flag, and a write into a
            read-only mapping crashes the process): read it through ``u.numpy()`` (an array that is not
            writeable) or copy it with ``u.cpu()``.
    """
    if not isinstance(u, UnifiedTensor):
        raise TypeError(f"host_tensor needs a unified tensor, got one on {u.device}")
    if u.read_only:
        raise ReadOnlyTableError(
            "host_tensor(u) would hand out a writable tensor over read-only memory; read it with u.numpy() "
            "(not writeable) or copy it with u.cpu()")
    return u._host


def set_affinity(u: torch.Tensor, affinity: Affinity) -> torch.Tensor:
    """Switch ``u``'s affinity in place (``"host"`` or ``"gpu"``); no data moves. Returns ``u``."""
    if not isinstance(u, UnifiedTensor):
        raise TypeError(f"set_affinity needs a unified tensor, got one on {u.device}")
    u.affinity = affinity
    return u
