"""Making unified tensors from existing memory, and getting at their host side."""
from __future__ import annotations

import numpy as np
import torch

from datapath._runtime.pinned import register_in_place
from datapath.unified_tensor.tensor import Affinity, UnifiedTensor


def as_unified(t: torch.Tensor | np.ndarray, affinity: Affinity = "host") -> UnifiedTensor:
    """The same memory as CPU tensor (or numpy array / memmap) ``t``, pinned in place, as a unified tensor.

    No copy is made: tables of tens of GB loaded with numpy or ``np.load(mmap_mode=...)``
    become GPU-readable where they lie.  The memory is unpinned when the last unified
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
    handle = register_in_place(t)
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
