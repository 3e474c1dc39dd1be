"""Registration of the ``"unified"`` device (PyTorch's PrivateUse1 slot, backed from Python).

After `register()`, ``torch.device("unified")`` exists, ``Tensor.to("unified")``,
``Tensor.is_unified`` and the factory functions (``torch.empty/zeros/ones/rand/randn``
with ``device="unified"``) produce `UnifiedTensor`s.  Registration happens once, when
datapath is imported.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from datapath._runtime.errors import DatapathError
from datapath._runtime.pinned import pinned_empty

NAME = "unified"
_lock = threading.Lock()
_library: list[Any] = []  # keeps the torch.library registration alive


class _UnifiedModule:
    """``torch.unified``: the device module PyTorch looks up for the renamed backend."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:  # host RNG is seeded by torch.manual_seed
        return None

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


def _empty_memory_format(size: Any, dtype: torch.dtype | None = None, layout: Any = None,
                         device: Any = None, pin_memory: Any = None,
                         memory_format: Any = None) -> torch.Tensor:
    from datapath.unified_tensor.tensor import UnifiedTensor  # noqa: PLC0415

    host = pinned_empty(tuple(size), dtype or torch.get_default_dtype())
    return UnifiedTensor(host)


def _empty_strided(size: Any, stride: Any, dtype: torch.dtype | None = None, layout: Any = None,
                   device: Any = None, pin_memory: Any = None) -> torch.Tensor:
    from datapath.unified_tensor.tensor import UnifiedTensor  # noqa: PLC0415

    dtype = dtype or torch.get_default_dtype()
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride) if s > 0) if all(s > 0 for s in size) else 0
    base = pinned_empty((extent,), dtype)
    return UnifiedTensor(base.as_strided(tuple(size), tuple(stride)))


def register() -> None:
    """Register the ``"unified"`` device once per process (idempotent)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    with _lock:
        current = torch._C._get_privateuse1_backend_name()
        if current == NAME and _library:
            return
        if current not in ("privateuseone", NAME):
            raise DatapathError(
                f"PyTorch's PrivateUse1 device is already named {current!r} by another library; "
                f"datapath needs it for the 'unified' device. Import datapath first or drop that library."
            )
        _setup_privateuseone_for_python_backend(NAME, backend_module=_UnifiedModule())
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.append(lib)
