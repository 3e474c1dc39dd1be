"""The one kernel-launch path of datapath, used by `datapath.memory` (row kernels, visit orders) and `datapath.ops`.

`datapath._runtime.kernels` compiles the sources (NVRTC through CuPy, once per variant and
device) and holds `DriverLaunch` (``cuLaunchKernelEx`` from one prepared buffer).  Here:

- `function`: a compiled kernel (CuPy ``Function``), looked up once per (source, name,
  options[, device]);
- `StreamRef` / `stream_ref`: the one stream reference CuPy's launcher reads (a raw handle as
  ``ptr``), so a launch goes to PyTorch's current stream without a stream context per call;
- `cpointer`: the one argument packer's pointer type (CuPy's ``CPointer``): a launcher handed
  pointers into a buffer of packed arguments instead of converting each one per call;
- `PackedLaunch`: a launch whose arguments live in such a buffer, the static ones written once, launched
  through ``cuLaunchKernelEx`` with prepared arguments (CuPy's launcher where the driver has none);
- `launch`: ``fn(grid, block, args, shared_mem, stream_ref(device))``.
"""
from __future__ import annotations

import ctypes
import functools
import struct
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


_LAUNCH_CONFIG = struct.Struct("<" + kernels._CONFIG_FORMAT)  # noqa: SLF001 - CUlaunchConfig, as DriverLaunch packs it
_STREAM_SLOT = struct.Struct("<Q")  # its hStream, at byte 32
_STREAM_OFFSET = 32
_INVALID_CONTEXT = kernels._CUDA_ERROR_INVALID_CONTEXT  # noqa: SLF001


class PackedLaunch:
    """One kernel's launch with its arguments packed in a buffer: the static ones written once.

    ``args`` are numpy scalars (np.int32 arguments occupy the low half of their 8-byte slot:
    the kernel reads 4 bytes there), tensors or None.  A tensor among the static arguments is
    written as its address and *held by the launch* for as long as the launch lives: an address
    baked into a kept launch must never outlive its memory (a launch kept past its graph would
    otherwise read freed memory the caching allocator has handed to another tensor).  Pass
    tensors, never `ptr` values, for static pointer arguments.  `__call__` writes the ``dynamic``
    slots (pointers, from tensors or None) and launches on the current stream; a lock keeps
    concurrent callers apart.  The launch goes through ``cuLaunchKernelEx`` with its configuration
    and the pointers to the buffer's slots prepared here (a call writes the stream only when it
    changes): the least host work per launch.  Where the driver has no ``cuLaunchKernelEx`` it goes
    through CuPy's launcher, handed pointers into the same buffer; where CuPy does not take packed
    pointers, every argument is converted per call instead.  Grid sizes below 1 launch one block
    (as CuPy's launcher does).
    """

    def __init__(self, fn: Any, grid: tuple[int, ...], block: int, args: Sequence[Any], dynamic: Sequence[int],
                 shared_mem: int = 0) -> None:
        self.fn, self.grid, self.block, self.shared_mem = fn, grid, (int(block),), shared_mem
        self.dynamic = tuple(dynamic)
        self.kept = tuple(a for a in args if isinstance(a, torch.Tensor))  # what the static addresses point into
        self.static = [ptr(a) if isinstance(a, torch.Tensor) else a for a in args]
        n = len(self.static)
        self.buf: Any = (ctypes.c_int64 * max(1, n))()  # little-endian: an int32 is its slot's low half
        for i, a in enumerate(self.static):
            if a is not None:
                self.buf[i] = int(a)  # ctypes keeps the low 64 bits: a uint64 address or a negative int32 as written
        base = ctypes.addressof(self.buf)
        self.packed: tuple | None = None
        cp = cpointer()
        if cp is not None and not isinstance(fn, Fallback):
            self.packed = tuple(cp(base + 8 * i) for i in range(n))
        self.driver: tuple | None = None  # (cuLaunchKernelEx, config, function, kernel params, extra)
        self.config: Any = None
        self.stream = 0
        ex = kernels._launch_ex()  # noqa: SLF001 - the one cuLaunchKernelEx handle
        cu_fn = getattr(fn, "ptr", None)
        if ex is not None and cu_fn and not isinstance(fn, Fallback):
            g = tuple(max(1, int(v)) for v in grid) + (1,) * (3 - len(grid))
            self.config = (ctypes.c_uint64 * (_LAUNCH_CONFIG.size // 8))()
            _LAUNCH_CONFIG.pack_into(self.config, 0, *g, max(1, int(block)), 1, 1, int(shared_mem), 0, 0, 0)
            params = (ctypes.c_void_p * max(1, n))(*(base + 8 * i for i in range(n)))
            self.driver = (ex, ctypes.c_void_p(ctypes.addressof(self.config)), ctypes.c_void_p(cu_fn), params, None)
        self.lock = threading.Lock()

    def _converted(self, tensors: tuple[torch.Tensor | None, ...]) -> tuple:
        args = list(self.static)
        for slot, t in zip(self.dynamic, tensors):
            args[slot] = ptr(t)
        return tuple(NULL if a is None else a for a in args)

    def __call__(self, device: int, *tensors: torch.Tensor | None) -> None:
        drv = self.driver
        if drv is not None:
            h = raw_stream(device)
            with self.lock:
                buf = self.buf
                for slot, t in zip(self.dynamic, tensors):
                    buf[slot] = 0 if t is None else t.data_ptr()
                if h != self.stream:
                    _STREAM_SLOT.pack_into(self.config, _STREAM_OFFSET, h)
                    self.stream = h
                rc = drv[0](*drv[1:])
                if rc == _INVALID_CONTEXT:  # a thread without a current context yet (autograd's
                    torch.cuda.current_stream(device).query()  # device thread): a runtime call binds the primary one
                    rc = drv[0](*drv[1:])
            if rc != 0:
                raise kernels.LaunchError(rc)
            return
        stream = stream_ref(device)
        with self.lock:
            if self.packed is None:
                self.fn(self.grid, self.block, self._converted(tensors), self.shared_mem, stream)
                return
            buf = self.buf
            for slot, t in zip(self.dynamic, tensors):
                buf[slot] = 0 if t is None else t.data_ptr()
            try:
                self.fn(self.grid, self.block, self.packed, self.shared_mem, stream)
            except TypeError:  # this CuPy wants plain values
                self.packed = None
                self.fn(self.grid, self.block, self._converted(tensors), self.shared_mem, stream)
