"""The one kernel-launch path of datapath, used by `datapath.memory` (row kernels, visit orders) and `datapath.ops`.

`datapath._runtime.kernels` compiles the sources (NVRTC through CuPy, once per variant and
device) and holds `DriverLaunch` (``cuLaunchKernelEx`` from one prepared buffer).  Here:

- `function`: a compiled kernel (CuPy ``Function``), looked up once per (source, name,
  options[, device]);
- `StreamRef` / `stream_ref`: the one stream reference CuPy's launcher reads (a raw handle as
  ``ptr``), so a launch goes to PyTorch's current stream without a stream context per call;
- `cpointer`: the one argument packer's pointer type (CuPy's ``CPointer``): a launcher handed
  pointers into a buffer of packed arguments instead of converting each one per call;
- `PackedLaunch`: a launch whose arguments live in such a buffer, the static ones written once;
- `launch`: ``fn(grid, block, args, shared_mem, stream_ref(device))``.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels

NULL = np.uint64(0)


class StreamRef:
    """What CuPy's ``Function.__call__`` reads of a stream: its raw handle as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_STREAMS: dict[int, StreamRef] = {}


def raw_stream(device: int) -> int:
    """The raw handle of PyTorch's current stream on ``device`` (the cheap query where torch has it)."""
    try:
        return torch._C._cuda_getCurrentRawStream(device)  # noqa: SLF001 - 0.2 us instead of 2 us
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_stream(device).cuda_stream


def stream_ref(device: int) -> StreamRef:
    """The `StreamRef` of PyTorch's current stream on ``device`` (one object per raw handle)."""
    h = raw_stream(device)
    ref = _STREAMS.get(h)
    if ref is None:
        ref = _STREAMS[h] = StreamRef(h)
    return ref


@functools.lru_cache(maxsize=None)
def function(source: str, name: str, options: tuple[str, ...] = (), device: int | None = None) -> Any:
    """The compiled kernel ``name`` of ``datapath/kernels/<source>`` (a CuPy ``Function``; `Fallback` where
    the ``RawKernel`` has none).  ``device``: part of the cache key only (compiled for the current device)."""
    raw = kernels.get_function(source, name, options)
    fn = getattr(raw, "kernel", None)
    return fn if fn is not None else Fallback(raw)


class Fallback:
    """A ``RawKernel`` without a ``kernel`` attribute: launched through `kernels.launch`."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        kernels.launch(self.raw, grid, block, args, shared_mem=shared_mem)


def launch(fn: Any, grid: int | tuple[int, ...], block: int, args: tuple, device: int, shared_mem: int = 0) -> None:
    """Launch ``fn`` on PyTorch's current stream of ``device``."""
    g = grid if isinstance(grid, tuple) else (int(grid),)
    fn(g, (int(block),), args, shared_mem, stream_ref(device))


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's address as a kernel argument (None: a null pointer)."""
    return NULL if t is None else np.uint64(t.data_ptr())


def cpointer() -> Any:
    """CuPy's ``CPointer`` (a launcher argument that is a pointer to a packed value), or None where CuPy has none
    (the caller converts every argument per call instead)."""
    try:
        from cupy.cuda.function import CPointer  # noqa: PLC0415 - optional GPU dependency
    except ImportError:  # pragma: no cover - a CuPy without it
        return None
    return CPointer


class PackedLaunch:
    """One kernel's launch with its arguments packed in a buffer: the static ones written once.

    ``args`` are numpy scalars (np.int32 arguments occupy the low half of their 8-byte slot:
    the kernel reads 4 bytes there), tensors or None.  A tensor among the static arguments is
    written as its address and *held by the launch* for as long as the launch lives: an address
    baked into a kept launch must never outlive its memory (a launch kept past its graph would
    otherwise read freed memory the caching allocator has handed to another tensor).  Pass
    tensors, never `ptr` values, for static pointer arguments.  `__call__` writes the ``dynamic``
    slots (pointers, from tensors or None) and launches on the current stream; a lock keeps
    concurrent callers apart.  Where CuPy does not take packed pointers, every argument is
    converted per call instead.
    """

    def __init__(self, fn: Any, grid: tuple[int, ...], block: int, args: Sequence[Any], dynamic: Sequence[int],
                 shared_mem: int = 0) -> None:
        self.fn, self.grid, self.block, self.shared_mem = fn, grid, (int(block),), shared_mem
        self.dynamic = tuple(dynamic)
        self.kept = tuple(a for a in args if isinstance(a, torch.Tensor))  # what the static addresses point into
        self.static = [ptr(a) if isinstance(a, torch.Tensor) else a for a in args]
        args = self.static
        self.buf: np.ndarray | None = None
        cp = cpointer()
        if cp is not None and not isinstance(fn, Fallback):
            self.buf = np.zeros(len(args), dtype=np.int64)  # little-endian: an int32 is its slot's low half
            for i, a in enumerate(args):
                if a is not None:
                    self.buf[i] = int(a)
            base = self.buf.ctypes.data
            self.packed = tuple(cp(base + 8 * i) for i in range(len(args)))
        self.lock = threading.Lock()

    def _converted(self, tensors: tuple[torch.Tensor | None, ...]) -> tuple:
        args = list(self.static)
        for slot, t in zip(self.dynamic, tensors):
            args[slot] = ptr(t)
        return tuple(NULL if a is None else a for a in args)

    def __call__(self, device: int, *tensors: torch.Tensor | None) -> None:
        stream = stream_ref(device)
        with self.lock:
            buf = self.buf
            if buf is None:
                self.fn(self.grid, self.block, self._converted(tensors), self.shared_mem, stream)
                return
            for slot, t in zip(self.dynamic, tensors):
                buf[slot] = 0 if t is None else t.data_ptr()
            try:
                self.fn(self.grid, self.block, self.packed, self.shared_mem, stream)
            except TypeError:  # this CuPy wants plain values
                self.buf = None
                self.fn(self.grid, self.block, self._converted(tensors), self.shared_mem, stream)
