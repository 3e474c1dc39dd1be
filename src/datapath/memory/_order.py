"""The visit order of a sorted row gather (``kernels/visit_order.cu``): indices grouped by bucket, buckets ascending.

Private to `datapath.memory`.  A sorted visit makes the rows in flight at once lie close
together in the table (random rows of a large host table are limited by address
translation).  `visit_order` returns the keys in visit order and each one's position in
the call (`sorted_visit`: their addresses, for the launches); `gather_config.sort_method`
picks how:

- ``"buckets"``: a counting sort into about one bucket per key, in one cooperative launch
  (`bucket_order_fused`); where the driver refuses a cooperative launch, the four-launch form.
- ``"buckets_unfused"``: the same counting sort in four launches (`bucket_order`): zero
  the histogram, count, cumulative sum, place.  Its host time is what a gather from an idle
  GPU waits for.
- ``"torch"``: ``torch.sort`` (exact; several times the counting sort's GPU time).
"""
from __future__ import annotations

import ctypes
import struct
import threading
import warnings
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels, launch
from datapath.memory.config import gather_config

_SOURCE = "visit_order.cu"
_THREADS = 256
# At most this many buckets a call (a 4 MiB histogram).
MAX_BUCKETS = 1 << 20
# CUDA driver errors that mean "no cooperative launch here" (the four-launch form is used instead):
# CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
_REFUSED = {1, 801, 720}
_CUDA_ERROR_INVALID_CONTEXT = 201


def _function(name: str) -> Any:
    """The compiled kernel ``name`` (a CuPy ``Function``) of the current device."""
    return launch.function(_SOURCE, name, (), torch.cuda.current_device())


def bucket_shift(n_keys: int, m: int) -> tuple[int, int]:
    """(shift, buckets): key k of ``m`` keys in [0, n_keys) goes to bucket ``k >> shift``.

    About as many buckets as keys (a power of two, at most ``MAX_BUCKETS``), so that a bucket
    holds a key or two and the grouped order is nearly the sorted one (coarser buckets read
    dense calls more slowly; see the CHANGELOG).
    """
    buckets = min(MAX_BUCKETS, 1 << max(0, (m - 1).bit_length()))
    rows = max(1, -(-n_keys // buckets))
    shift = (rows - 1).bit_length()
    return shift, ((max(n_keys, 1) - 1) >> shift) + 1


def _buffer(m: int, extra_words: int, device: torch.device | int) -> tuple[torch.Tensor, int, int, int]:
    """(one int64 allocation on ``device``, address of the grouped keys (m words of the key dtype), address of the
    order (m int64), address of ``extra_words`` uint32 of scratch)."""
    buf = torch.empty(2 * m + (extra_words + 1) // 2, dtype=torch.int64, device=device)
    base = buf.data_ptr()
    return buf, base + 8 * m, base, base + 16 * m


def _views(buf: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(grouped keys (m,) of ``dtype``, order (m,) int64) of a `_buffer`."""
    grouped = buf[m:2 * m] if dtype == torch.int64 else buf[m:2 * m].view(torch.int32)[:m]
    return grouped, buf[:m]


def bucket_order(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys grouped by bucket, buckets ascending; each one's position in ``keys``, int64), on the GPU, no waiting.

    ``keys``: (m,) int32/int64 CUDA, row numbers of a table of ``n_keys`` rows (negatives wrap as
    in the row kernels).  Four launches on the current stream (the histogram's zeroing, the
    histogram, its cumulative sum, the placement).
    """
    m = keys.numel()
    shift, n_buckets = bucket_shift(n_keys, m)
    suffix = "i32" if keys.dtype == torch.int32 else "i64"
    dev = keys.device
    stream = launch.StreamRef(torch.cuda.current_stream(dev).cuda_stream)
    grid = (max(1, min(-(-m // _THREADS), 4 * kernels.multiprocessor_count(dev.index))),)
    common = (kernels.ptr(keys), np.int64(m), np.int64(n_keys), np.int32(shift), np.uint32(n_buckets))
    counts = torch.zeros(n_buckets, dtype=torch.int32, device=dev)
    _function(f"bucket_count_{suffix}")(grid, (_THREADS,), (*common, kernels.ptr(counts)), 0, stream)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    grouped, order = _views(_buffer(m, 0, dev)[0], m, keys.dtype)
    _function(f"bucket_place_{suffix}")(
        grid, (_THREADS,), (*common, kernels.ptr(ends), kernels.ptr(grouped), kernels.ptr(order)), 0, stream)
    return grouped, order


# kernel arguments of bucket_order_*: keys, m, n_keys, shift, n_buckets, hist, bar, sorted, order
_ARGS = "QqqiIQQQQ"
_PACK = struct.Struct("<" + _ARGS)
_OFFSETS = (0, 8, 16, 24, 28, 32, 40, 48, 56)


class _Fused:
    """The one-launch counting sort of one device and key dtype: its grid limit and its launch (``cuLaunchKernelEx``
    with the cooperative attribute from one prepared buffer, or ``cuLaunchCooperativeKernel`` where the driver
    lacks the former)."""

    __slots__ = ("cu_fn", "max_blocks", "args", "params", "lock", "device", "driver")

    def __init__(self, device: int, suffix: str) -> None:
        fn = _function(f"bucket_order_{suffix}")
        self.cu_fn = fn.ptr
        self.device = device
        lib = kernels.libcuda()
        per_sm = ctypes.c_int(0)
        rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per_sm), ctypes.c_void_p(self.cu_fn),
                                                             _THREADS, ctypes.c_size_t(0))
        if rc != 0 or per_sm.value < 1:
            raise _Refused(f"occupancy query failed (CUDA error {rc}, {per_sm.value} blocks per SM)")
        # every block must be resident at once; more than 4 a multiprocessor only adds barrier arrivals
        self.max_blocks = min(per_sm.value, 4) * kernels.multiprocessor_count(device)
        self.driver = kernels.DriverLaunch(fn, _ARGS, _THREADS, device, cooperative=True)
        self.args = ctypes.create_string_buffer(_PACK.size)
        base = ctypes.addressof(self.args)
        self.params = (ctypes.c_void_p * len(_OFFSETS))(*(base + o for o in _OFFSETS))
        self.lock = threading.Lock()

    def launch(self, keys_ptr: int, m: int, n_keys: int, shift: int, n_buckets: int, grouped_ptr: int,
               order_ptr: int, hist_ptr: int) -> None:
        """Queue the ordering of the ``m`` keys at ``keys_ptr`` on the current stream (addresses from `_buffer`)."""
        blocks = self.grid_for(m)
        stream = torch._C._cuda_getCurrentRawStream(self.device)  # noqa: SLF001 - the cheap raw-handle query
        bar = _barrier(self.device, stream)
        if self.driver.available:
            try:
                self.driver.launch(blocks, stream, keys_ptr, m, n_keys, shift, n_buckets, hist_ptr, bar, grouped_ptr,
                                   order_ptr)
                return
            except kernels.LaunchError as exc:
                rc = exc.rc
        else:
            launch = _cooperative_launch()
            with self.lock:
                _PACK.pack_into(self.args, 0, keys_ptr, m, n_keys, shift, n_buckets, hist_ptr, bar, grouped_ptr,
                                order_ptr)
                rc = launch(self.cu_fn, blocks, 1, 1, _THREADS, 1, 1, 0, stream, self.params)
                if rc == _CUDA_ERROR_INVALID_CONTEXT:  # a thread without a current context yet: a runtime call
                    torch.cuda.current_stream(self.device).query()  # binds the device's primary context
                    rc = launch(self.cu_fn, blocks, 1, 1, _THREADS, 1, 1, 0, stream, self.params)
        if rc in _REFUSED:
            raise _Refused(f"the cooperative launch of {blocks} blocks was refused (CUDA error {rc})")
        if rc != 0:
            raise RuntimeError(f"the cooperative launch of the visit-order kernel failed with CUDA error {rc}")

    def grid_for(self, m: int) -> int:
        """Blocks of the launch for ``m`` keys (its scratch holds one word per block)."""
        return max(1, min(-(-m // _THREADS), self.max_blocks))


class _Refused(RuntimeError):
    """No cooperative launch on this device or driver."""


_coop: list[Any] = []


def _cooperative_launch() -> Any:
    if not _coop:
        lib = kernels.libcuda()
        fn = getattr(lib, "cuLaunchCooperativeKernel", None) if lib is not None else None
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        _coop.append(fn)
    if _coop[0] is None:
        raise _Refused("libcuda has no cuLaunchCooperativeKernel")
    return _coop[0]


# one two-word grid barrier per (device, stream): launches on one stream run one after another,
# and the barrier's arrival count is back at 0 when a launch ends
_barriers: dict[tuple[int, int], torch.Tensor] = {}
_fused: dict[tuple[int, torch.dtype], _Fused | None] = {}
_fused_lock = threading.Lock()


def _barrier(device: int, stream: int) -> int:
    t = _barriers.get((device, stream))
    if t is None:
        t = _barriers[(device, stream)] = torch.zeros(2, dtype=torch.int32, device=f"cuda:{device}")
    return t.data_ptr()


def _fused_for(device: int, dtype: torch.dtype) -> _Fused | None:
    key = (device, dtype)
    if key not in _fused:
        with _fused_lock:
            if key not in _fused:
                try:
                    _fused[key] = _Fused(device, "i32" if dtype == torch.int32 else "i64")
                except _Refused as exc:
                    _refuse(key, exc)
    return _fused[key]


def _refuse(key: tuple[int, torch.dtype], exc: Exception) -> None:
    _fused[key] = None
    warnings.warn(f"sorted gathers order their indices in four launches instead of one on cuda:{key[0]}: {exc}",
                  RuntimeWarning, stacklevel=3)


def _fused_into(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, int, int] | None:
    """The one-launch ordering of ``keys`` (on the current device) queued: (its `_buffer`, address of the grouped
    keys, address of the order); None where the driver refuses a cooperative launch."""
    m = keys.numel()
    device = keys.get_device()
    fused = _fused_for(device, keys.dtype)
    if fused is None:
        return None
    shift, n_buckets = bucket_shift(n_keys, m)
    buf, grouped_ptr, order_ptr, hist_ptr = _buffer(m, n_buckets + fused.grid_for(m), keys.device)
    try:
        fused.launch(keys.data_ptr(), m, n_keys, shift, n_buckets, grouped_ptr, order_ptr, hist_ptr)
    except _Refused as exc:
        _refuse((device, keys.dtype), exc)
        return None
    return buf, grouped_ptr, order_ptr


def bucket_order_fused(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`bucket_order` in one cooperative launch (the four-launch form where the driver refuses one).

    ``keys``: (m,) int32/int64 CUDA, m >= 1.
    """
    if torch._C._cuda_getDevice() != keys.get_device():  # noqa: SLF001 - the cheap current-device query
        with torch.cuda.device(keys.get_device()):
            return bucket_order_fused(keys, n_keys)
    got = _fused_into(keys, n_keys)
    return bucket_order(keys, n_keys) if got is None else _views(got[0], keys.numel(), keys.dtype)


def visit_order(keys: torch.Tensor, sort: bool, n_keys: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keys in the order the kernel visits them, their output positions or None).

    ``keys``: (m,) int32/int64 row numbers of a table of ``n_keys`` rows.  Unsorted visits
    keep ``keys``; sorted ones order them by ``gather_config.sort_method``.
    """
    if not sort:
        return keys, None
    method = gather_config.sort_method
    if method == "torch" or not keys.is_cuda or keys.numel() == 0:
        return torch.sort(keys)
    if method == "buckets_unfused":
        return bucket_order(keys, n_keys)
    return bucket_order_fused(keys, n_keys)


def sorted_visit(keys: torch.Tensor, n_keys: int) -> tuple[object, int, int]:
    """A sorted visit of ``keys`` queued, as addresses: (what keeps both arrays alive until the launch that reads
    them is queued, address of the keys in visit order, address of their output positions, int64).

    The launches' hot path: no tensor views made (a few microseconds that a call from an idle GPU waits for).
    ``keys``: (m,) int32/int64 CUDA.
    """
    if (gather_config.sort_method == "buckets" and keys.numel()
            and torch._C._cuda_getDevice() == keys.get_device()):  # noqa: SLF001 - the cheap current-device query
        got = _fused_into(keys, n_keys)
        if got is not None:
            return got
    grouped, order = visit_order(keys, True, n_keys)
    return (grouped, order), grouped.data_ptr(), order.data_ptr()
