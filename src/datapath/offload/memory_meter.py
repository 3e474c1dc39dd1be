"""How much device memory a step holds: what the memory budget is measured against.

`CudaMeter` reads the caching allocator's counters (``memory_allocated``, and the
peak since the last `lap`, which resets ``max_memory_allocated``: with a memory
budget, a lap starts when each forward begins, so ``torch.cuda.max_memory_allocated()``
read after a step reports that step's peak; during the one profiled step laps
also start at every unit).  `CpuMeter` counts, on a machine without a GPU,
the bytes of the model's parameters and buffers plus every storage a torch op
creates on this thread while the cache's hooks are active (a dispatch mode):
the same quantity, so the CPU tests exercise the budget end to end.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class MemoryMeter:
    """Bytes held now (`allocated`) and the most held since the previous `lap`."""

    def allocated(self) -> int:
        raise NotImplementedError

    def lap(self) -> int:
        """The peak since the previous lap; a new lap starts now."""
        raise NotImplementedError

    def peak(self) -> int:
        """The peak since the previous lap, without starting a new one (the counters stay as they are)."""
        raise NotImplementedError

    def total(self) -> int:
        """The device's memory (what a fractional budget is a fraction of)."""
        raise NotImplementedError

    def __enter__(self) -> "MemoryMeter":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class CudaMeter(MemoryMeter):
    """The CUDA caching allocator's counters for ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def lap(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of CPU storages created by torch ops (this thread) while they are alive."""

    def __init__(self, meter: "CpuMeter") -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        m = self.meter
        inputs = {_data_ptr(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key, nbytes = id(st), st.nbytes()
            if nbytes == 0 or key in m.keys or _data_ptr(t) in inputs:
                continue  # empty, already counted, or an input's storage returned (views, in-place ops)
            m.keys.add(key)
            m.add(nbytes)
            weakref.finalize(st, m.free, key, nbytes)
        return out


def _data_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a storage freed in place (FSDP2 resizes an unsharded
    parameter's storage to 0 between uses: its Python storage is then invalid)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class CpuMeter(MemoryMeter):
    """``base`` bytes (parameters, buffers) plus the live bytes of storages created by ops in the hooks."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.live = 0
        self.high = 0
        self.keys: set[int] = set()
        self._modes: list[_LiveBytes] = []

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.high = max(self.high, self.live)

    def free(self, key: int, nbytes: int) -> None:
        if key in self.keys:
            self.keys.discard(key)
            self.live -= nbytes

    def allocated(self) -> int:
        return self.base + self.live

    def lap(self) -> int:
        high, self.high = self.high, self.live
        return self.base + high

    def peak(self) -> int:
        return self.base + self.high

    def total(self) -> int:
        import psutil  # noqa: PLC0415

        return int(psutil.virtual_memory().total)

    def __enter__(self) -> "CpuMeter":
        mode = _LiveBytes(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._modes.pop().__exit__(*exc)


def meter_for(device: torch.device, base: int = 0) -> MemoryMeter:
    """A `CudaMeter` for a CUDA device, else a `CpuMeter` starting at ``base`` bytes."""
    return CudaMeter(device) if device.type == "cuda" else CpuMeter(base)
