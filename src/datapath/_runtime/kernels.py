"""Run-time loading of the CUDA sources in ``datapath/kernels`` through CuPy (NVRTC).

Nothing is compiled at install time: a module is compiled on first use, once per
process and device, and CuPy's on-disk cache makes later processes start fast.
Kernels are launched on PyTorch's current CUDA stream, so they order correctly
with the surrounding PyTorch work.

    mod = load_module("gather.cu")
    launch(mod.get_function("gather_rows"), grid, block, (ptr(src), ptr(out), ...))
"""
from __future__ import annotations

import ctypes
import functools
import importlib.resources
import struct
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from datapath._runtime.device import require_cuda
from datapath._runtime.errors import KernelLoadError


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 - optional, GPU-only dependency
    except Exception as exc:  # noqa: BLE001
        raise KernelLoadError(
            "datapath's CUDA kernels need CuPy; install it with "
            "`pip install 'datapath[gpu]'` (or cupy-cuda12x / cupy-cuda13x matching your driver)."
        ) from exc
    return cupy


# NVRTC compiles without the C++ standard library headers: the fixed-width integer
# types that kernels use are defined here and the includes that would provide them
# are dropped, so the same sources also build with nvcc.
_PRELUDE = """
typedef signed char int8_t; typedef unsigned char uint8_t;
typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t;
typedef long long int64_t; typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t; typedef long long intptr_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
"""
_STD_INCLUDES = ("#include <cstdint>", "#include <stdint.h>", "#include <cstddef>", "#include <stddef.h>",
                 "#include <cmath>", "#include <math.h>", "#include <cfloat>", "#include <float.h>")


def _read_kernel_text(filename: str, seen: tuple[str, ...] = ()) -> str:
    """``datapath/kernels/<filename>`` with its local ``#include "x.cuh"`` lines inlined (once each)."""
    try:
        text = importlib.resources.files("datapath.kernels").joinpath(filename).read_text()
    except FileNotFoundError as exc:
        raise KernelLoadError(f"no kernel source datapath/kernels/{filename}") from exc
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if s in _STD_INCLUDES:
            continue
        if s.startswith('#include "') and s.endswith('.cuh"'):
            header = s[len('#include "'):-1]
            if header not in seen:
                lines.append(_read_kernel_text(header, (*seen, header)))
            continue
        lines.append(line)
    return "\n".join(lines)


def kernel_source(filename: str) -> str:
    """The text of ``datapath/kernels/<filename>`` as NVRTC compiles it (with the prelude and local headers)."""
    return _PRELUDE + _read_kernel_text(filename) + "\n"


@functools.lru_cache(maxsize=None)
def _load(filename: str, options: tuple[str, ...], device: int) -> Any:
    cupy = _cupy()
    src = kernel_source(filename)
    cc = torch.cuda.get_device_capability(device)
    opts = ("--std=c++17", f"--gpu-architecture=sm_{cc[0]}{cc[1]}", *options)
    with cupy.cuda.Device(device):
        try:
            mod = cupy.RawModule(code=src, options=opts)
            mod.compile()
        except Exception as exc:  # noqa: BLE001 - NVRTC errors come as several types
            raise KernelLoadError(f"compiling datapath/kernels/{filename} failed: {exc}") from exc
    return mod


def load_module(filename: str, options: Sequence[str] = ()) -> Any:
    """Compile (once) and return the CuPy ``RawModule`` for ``datapath/kernels/<filename>``."""
    dev = require_cuda(f"the CUDA kernel {filename}")
    return _load(filename, tuple(options), dev.index)


def get_function(filename: str, name: str, options: Sequence[str] = ()) -> Any:
    """A ``cupy.RawKernel`` from ``datapath/kernels/<filename>`` (``extern "C"`` name)."""
    return load_module(filename, options).get_function(name)


def ptr(t: torch.Tensor | int) -> np.uint64:
    """A tensor's data pointer as a kernel argument (``T*`` parameters take 64-bit values)."""
    return np.uint64(t if isinstance(t, int) else t.data_ptr())


def launch(kernel: Any, grid: int | tuple[int, ...], block: int | tuple[int, ...],
           args: tuple[Any, ...], shared_mem: int = 0,
           stream: torch.cuda.Stream | None = None) -> None:
    """Launch ``kernel`` on ``stream`` (default: PyTorch's current stream)."""
    s = stream if stream is not None else torch.cuda.current_stream()
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    with _cupy_stream(s.cuda_stream, s.device.index):
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=64)
def _cupy_stream(handle: int, device: int) -> Any:
    """CuPy's view of the CUDA stream ``handle`` (cached: made once per stream)."""
    cupy = _cupy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ExternalStream: deprecated in CuPy 14, still right
        return cupy.cuda.ExternalStream(handle, device)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: int | None = None) -> int:
    """Number of SMs of ``device`` (current device by default)."""
    dev = torch.cuda.current_device() if device is None else device
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=None)
def libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library through ctypes, loaded once (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def driver_entry(name: str) -> int:
    """The address of the CUDA driver's function ``name`` (0 where the driver cannot be loaded or lacks it)."""
    lib = libcuda()
    fn = getattr(lib, name, None) if lib is not None else None
    return (ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0


_CONFIG_FORMAT = "7I4xQQI4x"  # CUlaunchConfig: grid x, y, z, block x, y, z, shared bytes, stream, attrs, num_attrs
_CUDA_ERROR_INVALID_CONTEXT = 201
# CUlaunchAttribute: id (CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2), 4 bytes of padding, a 64-byte value union whose
# first int is ``cooperative``
_COOPERATIVE_ATTR = struct.Struct("<I4xi60x")
_CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2


@functools.lru_cache(maxsize=None)
def _launch_ex() -> Any:
    """``cuLaunchKernelEx`` from libcuda (None where the driver lacks it or cannot be loaded)."""
    lib = libcuda()
    fn = getattr(lib, "cuLaunchKernelEx", None) if lib is not None else None
    if fn is not None:
        fn.restype = ctypes.c_int  # arguments: prepared ctypes objects, passed as they are
    return fn


class LaunchError(RuntimeError):
    """``cuLaunchKernelEx`` refused a launch; ``rc`` is its CUDA status."""

    def __init__(self, rc: int) -> None:
        super().__init__(f"cuLaunchKernelEx failed with CUDA error {rc}")
        self.rc = rc


class DriverLaunch:
    """One kernel launched through ``cuLaunchKernelEx`` from one prepared buffer: the cheapest launch from Python.

    The buffer holds the launch configuration and the kernel's arguments (``arg_format``, a
    `struct` format without byte-order prefix, one code per parameter, packed without padding);
    a launch packs the grid, the stream and the arguments with one ``pack_into`` and calls the
    driver with four prepared arguments (less host time than CuPy's launcher).  ``available`` is False where the driver has no
    ``cuLaunchKernelEx``: the caller launches another way.  ``arg_ptrs``: the address of each
    argument in the buffer (for a launcher taking pointers to the values).  ``cooperative``: the
    launch carries the cooperative attribute (all blocks resident at once, as
    ``cuLaunchCooperativeKernel``; a grid too large fails with the driver's status in a `LaunchError`).
    """

    __slots__ = ("available", "threads", "device", "struct", "buf", "arg_ptrs", "ex_args", "lock", "attrs",
                 "attr_ptr", "n_attrs")

    def __init__(self, fn: Any, arg_format: str, threads: int, device: int, cooperative: bool = False) -> None:
        self.threads, self.device = threads, device
        # ``cooperative``: launched as cuLaunchCooperativeKernel would (every block resident at once, or an error)
        self.attrs = ctypes.create_string_buffer(_COOPERATIVE_ATTR.size) if cooperative else None
        if self.attrs is not None:
            _COOPERATIVE_ATTR.pack_into(self.attrs, 0, _CU_LAUNCH_ATTRIBUTE_COOPERATIVE, 1)
        self.attr_ptr = ctypes.addressof(self.attrs) if self.attrs is not None else 0
        self.n_attrs = 1 if cooperative else 0
        self.struct = struct.Struct("<" + _CONFIG_FORMAT + arg_format)
        self.buf = (ctypes.c_uint64 * (-(-self.struct.size // 8)))()
        base = ctypes.addressof(self.buf)
        start = struct.calcsize("<" + _CONFIG_FORMAT)
        self.arg_ptrs = tuple(base + start + struct.calcsize("<" + arg_format[:i]) for i in range(len(arg_format)))
        params = (ctypes.c_void_p * len(arg_format))(*self.arg_ptrs)
        ex = _launch_ex()
        cu_fn = getattr(fn, "ptr", None)
        self.available = ex is not None and bool(cu_fn)
        # cuLaunchKernelEx and its four arguments (config, function, kernel params, extra); params kept alive here
        self.ex_args = (ex, ctypes.c_void_p(base), ctypes.c_void_p(cu_fn), params, None) if self.available else None
        self.lock = threading.Lock()

    def launch(self, blocks: int, stream: int, *args: int) -> None:
        """Queue the kernel: ``blocks`` blocks on the raw CUDA stream ``stream`` (requires ``available``).

        Raises:
            LaunchError: the driver refused the launch (its status in ``rc``).
        """
        ex_args = self.ex_args
        with self.lock:
            self.struct.pack_into(self.buf, 0, blocks, 1, 1, self.threads, 1, 1, 0, stream, self.attr_ptr,
                                  self.n_attrs, *args)
            rc = ex_args[0](*ex_args[1:])  # type: ignore[index]
            if rc == _CUDA_ERROR_INVALID_CONTEXT:  # a thread without a current context yet: a runtime
                torch.cuda.current_stream(self.device).query()  # call binds the device's primary context
                rc = ex_args[0](*ex_args[1:])  # type: ignore[index]
        if rc != 0:
            raise LaunchError(rc)

    def values(self) -> tuple[int, ...]:
        """The arguments of the last launch, as packed (for a launcher taking values)."""
        return tuple(self.struct.unpack_from(self.buf, 0)[10:])
