"""The ``"unified"`` device name.

Two levels:

- Always, from ``import datapath``: ``t.to("unified")`` returns a `UnifiedTensor`
  (a copy in pinned host memory) and ``t.is_unified`` tells one apart.  The
  tensor's ``device`` is ``cpu`` as far as PyTorch's C++ side is concerned (its
  memory *is* host memory); its ``__torch_dispatch__`` applies the placement rules.
- Opt-in, `register_device()` (or ``DATAPATH_UNIFIED_DEVICE=1`` before the import):
  PyTorch's PrivateUse1 slot is renamed ``"unified"`` and backed from Python, so
  ``torch.device("unified")``, ``torch.empty/zeros/ones/rand/randn(...,
  device="unified")`` work and new unified tensors report ``device.type ==
  "unified"``.  The price, in PyTorch 2.8 and later: a named PrivateUse1 backend
  becomes the process's default accelerator, and autograd then finds no stream for
  CUDA nodes, so every CUDA ``backward()`` in the process fails
  (``opt_ready_stream && opt_parent_stream``, pytorch/pytorch#161129), and the
  registration cannot be undone.  Register the device only in processes that do
  no CUDA training (data preparation, inference).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from datapath._runtime.errors import DatapathError
from datapath._runtime.pinned import pinned_empty
from datapath.memory.placement import is_unified

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


def _route_pinning_to_cuda() -> None:
    """Keep ``Tensor.pin_memory()`` and ``Tensor.is_pinned()`` meaning CUDA pinned memory.

    PyTorch treats a renamed PrivateUse1 backend as the process's default
    accelerator, ahead of CUDA; the two methods, called without a device (as
    user code and ``DataLoader(pin_memory=True)`` do), would then ask the unified
    device for a pinned-memory allocator, which a Python backend cannot provide.
    The unified device's pinned memory *is* CUDA's, so both are routed there.
    """
    if getattr(torch.Tensor.pin_memory, "_datapath_routed", False):
        return
    orig_pin, orig_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def _target(device: Any) -> Any:
        if device is None or torch.device(device).type == NAME:
            return "cuda" if torch.cuda.is_available() else None
        return device

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        target = _target(device)
        if target is None:
            return orig_pin(self)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the device argument is deprecated, and needed here
            return orig_pin(self, target)

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        target = _target(device)
        if target is None:
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return orig_is_pinned(self, target)

    pin_memory._datapath_routed = True  # type: ignore[attr-defined]
    pin_memory.__doc__, is_pinned.__doc__ = orig_pin.__doc__, orig_is_pinned.__doc__
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign]


def device_registered() -> bool:
    """True once `register_device` has named PrivateUse1 ``"unified"`` in this process."""
    return bool(_library)


def install_to_unified() -> None:
    """Make ``Tensor.to("unified")`` and ``Tensor.is_unified`` work (no device registration needed).

    ``Tensor.to`` is wrapped once per process.  PyTorch's own ``to`` runs first; only when it
    rejects the device string (``"unified"`` is no device PyTorch knows until `register_device`)
    does the wrapper look at the arguments.  So a call that does not name the unified device
    pays for one Python call around the C method: about 0.2-0.5 us (``benchmarks/tensor_to.py``
    measures it per call form).  ``UnifiedTensor.to`` handles the unified tensor's own moves.
    """
    from datapath.unified_tensor.tensor import to_unified  # noqa: PLC0415

    if getattr(torch.Tensor.to, "_datapath_routed", False):
        return
    orig_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _library and _names_unified(args, kwargs):  # registered: PyTorch would parse "unified" itself
            return _to_unified(self, args, kwargs, to_unified)
        try:
            return orig_to(self, *args, **kwargs)
        except RuntimeError:
            if not _names_unified(args, kwargs):
                raise
        return _to_unified(self, args, kwargs, to_unified)

    to._datapath_routed = True  # type: ignore[attr-defined]
    to.__doc__ = orig_to.__doc__
    torch.Tensor.to = to  # type: ignore[method-assign]
    _set_is_unified()


def _names_unified(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when a ``to(...)`` call's device argument is the unified device."""
    dev = args[0] if args else kwargs.get("device")
    if dev.__class__ is str:
        return dev == NAME or dev.startswith(NAME + ":")
    return isinstance(dev, torch.device) and dev.type == NAME


def _to_unified(t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], to_unified: Any) -> Any:
    dtype = kwargs.get("dtype")
    if dtype is None and len(args) > 1 and isinstance(args[1], torch.dtype):
        dtype = args[1]
    return to_unified(t, dtype)


def _set_is_unified() -> None:
    """``Tensor.is_unified``: `datapath.memory.is_unified`, the one answer."""
    torch.Tensor.is_unified = property(  # type: ignore[attr-defined]
        is_unified, doc="True for a tensor in unified (pinned, GPU-mapped) host memory."
    )


def register_device() -> None:
    """Name PyTorch's PrivateUse1 device ``"unified"`` (idempotent; cannot be undone).

    Read the module docstring first: in PyTorch >= 2.8 this breaks CUDA autograd in
    the whole process.
    """
    if "is_unified" in vars(torch.Tensor) and not _library:
        delattr(torch.Tensor, "is_unified")  # PyTorch generates its own; ours is put back below
    try:
        register()
    finally:
        _set_is_unified()


def register() -> None:
    """Register the PrivateUse1 backend as ``"unified"`` once per process (idempotent)."""
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
        if current != NAME:
            _setup_privateuseone_for_python_backend(NAME, backend_module=_UnifiedModule())
        _route_pinning_to_cuda()
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.append(lib)
        from datapath.unified_tensor.tensor import use_unified_device  # noqa: PLC0415

        use_unified_device()
