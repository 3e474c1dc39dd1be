"""Kernel launches with as little host work as possible: the aggregation's fixed cost per call.

`datapath._runtime.kernels` compiles the sources (NVRTC through CuPy, once per variant);
here each variant's CuPy ``Function`` is looked up once per (source, name, options) and
launched on PyTorch's current stream directly (no stream context switch per call).
`PackedLaunch` keeps a launch's arguments in one numpy buffer that CuPy is handed pointers
into, so a call writes only the pointers that change (a few hundred nanoseconds) instead of
converting every argument (about a microsecond each).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels

KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
NULL = np.uint64(0)


class _StreamRef:
    """What CuPy's ``Function.__call__`` needs of a stream: its handle as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_STREAMS: dict[int, _StreamRef] = {}


def _raw_stream(device: int) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(device)  # noqa: SLF001 - 0.2 us instead of 2 us
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_stream(device).cuda_stream


def current_stream(device: int) -> _StreamRef:
    h = _raw_stream(device)
    ref = _STREAMS.get(h)
    if ref is None:
        ref = _STREAMS[h] = _StreamRef(h)
    return ref


@functools.lru_cache(maxsize=None)
def function(source: str, name: str, options: tuple[str, ...]) -> Any:
    """The compiled kernel ``name`` of ``datapath/kernels/<source>`` (CuPy ``Function``)."""
    raw = kernels.get_function(source, name, options)
    fn = getattr(raw, "kernel", None)
    return fn if fn is not None else _Fallback(raw)


class _Fallback:
    """A ``RawKernel`` without a ``kernel`` attribute: launched through `kernels.launch`."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        kernels.launch(self.raw, grid, block, args, shared_mem=shared_mem)


def options(dtype: torch.dtype, vec: int, idx_dtype: torch.dtype, *extra: str) -> tuple[str, ...]:
    opts = [f"-DDP_KIND={KIND[dtype]}", f"-DDP_VEC={vec}"]
    if idx_dtype == torch.int64:
        opts.append("-DDP_IDX_64")
    return (*opts, *extra)


def launch(fn: Any, grid: int | tuple[int, ...], block: int, args: tuple, device: int, shared_mem: int = 0) -> None:
    """Launch ``fn`` on PyTorch's current stream of ``device``."""
    g = grid if isinstance(grid, tuple) else (int(grid),)
    fn(g, (int(block),), args, shared_mem, current_stream(device))


def ptr(t: torch.Tensor | None) -> np.uint64:
    return NULL if t is None else np.uint64(t.data_ptr())


def aligned_vec(vec: int, feat: int, elem: int, *tensors: torch.Tensor | None) -> int:
    """``vec`` narrowed until it divides ``feat`` and every tensor's base address is aligned to it."""
    while vec > 1 and (feat % vec or any(t is not None and t.data_ptr() % (vec * elem) for t in tensors)):
        vec //= 2
    return vec


def _cpointer() -> Any:
    try:
        from cupy.cuda.function import CPointer  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a CuPy without it: arguments are converted per call
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
        cp = _cpointer()
        if cp is not None and not isinstance(fn, _Fallback):
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
        stream = current_stream(device)
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
