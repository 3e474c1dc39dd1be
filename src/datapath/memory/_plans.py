"""Launch plans of the row kernels, and keeping host tables alive behind their launches; no waiting anywhere.

Private to `datapath.memory`.

`RowPlan`: what a launch needs that depends only on the row geometry (direction, index
dtype, alignment scheme, device, row size and stride, word width, grid settings): the
compiled kernel, the lanes per row, the grid limit, and an argument block that the
launch reads by pointer.  A call packs the ten arguments with one ``struct.pack_into``
and launches through CuPy's launcher with packed pointers (the default, measured the
faster), or through ``cuLaunchKernel`` directly via ctypes (``DATAPATH_GATHER_LAUNCHER=ctypes``).

`HostTable`: one record per host table tensor, made on its first fetch: its row layout
(so a call does not work it out again), its plans, and the streams its launches were
queued on.  A kernel over host memory runs after the call returns, so the memory must
outlive it: the record holds the table's storage, and when the table tensor dies it
records one event on each of those streams (behind every launch queued there) and keeps
the storage (`retiring`) until they have completed; the next new record drops what has.
No per-call event, no waiting.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels
from datapath.memory import _launch
from datapath.memory.config import gather_config

_SLOTS = 10  # kernel arguments: (table, n_rows, row_stride, row_bytes, idx, order, n_idx, dev, G, err)
_PACK = struct.Struct("<QqqqQQqQqQ")
_CUDA_ERROR_INVALID_CONTEXT = 201

# "cupy" (CuPy's launcher with packed pointers: measured 27 us per gather call, H100 machine) or "ctypes"
# (cuLaunchKernel through ctypes: 31 us, its eleven arguments converted per call)
LAUNCHER = os.environ.get("DATAPATH_GATHER_LAUNCHER", "cupy")


def _cpointer() -> Any:
    try:
        from cupy.cuda.function import CPointer  # noqa: PLC0415 - optional GPU dependency
    except ImportError:  # pragma: no cover - a CuPy without it: the converting launch is used
        return None
    return CPointer


_launch_fn: list[Any] = []


def _cu_launch() -> Any:
    """``cuLaunchKernel`` from libcuda (None where it cannot be loaded)."""
    if not _launch_fn:
        lib = kernels.libcuda()
        fn = getattr(lib, "cuLaunchKernel", None) if lib is not None else None
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        _launch_fn.append(fn)
    return _launch_fn[0]


class _StreamRef:
    """What CuPy's ``Function.__call__`` reads of a stream: its raw handle as ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_streams: dict[tuple[int, int], tuple[_StreamRef, torch.cuda.Stream]] = {}


def current_stream(device: int) -> tuple[tuple[int, int], _StreamRef, torch.cuda.Stream]:
    """(key, CuPy's view, PyTorch's object) of ``device``'s current stream, made once per (device, handle).

    (The default stream's handle is 0 on every device.)
    """
    key = (device, torch._C._cuda_getCurrentRawStream(device))  # noqa: SLF001 - 0.2 us instead of 2 us
    s = _streams.get(key)
    if s is None:
        s = _streams[key] = (_StreamRef(key[1]), torch.cuda.current_stream(device))
    return key, s[0], s[1]


class RowPlan:
    """The launch of ``{gather,scatter}_w{W}_m{MODE}_{i32,i64}`` for one row geometry, worked out once.

    Attributes:
        rows_per_block, max_blocks: the grid is ``min(ceil(m / rows_per_block), max_blocks)``.
    """

    __slots__ = ("rows_per_block", "max_blocks", "threads", "block", "fn", "cu_fn", "args", "params", "params_ptr",
                 "packed", "static", "lock", "device", "on_host")

    def __init__(self, name: str, all_modes: bool, row_bytes: int, row_stride: int, w: int, mode_id: int,
                 device: int, on_host: bool) -> None:
        g, per_group = _launch.lanes_and_rows(row_bytes // w, w, mode_id)
        self.threads = gather_config.threads_per_block
        self.block = (self.threads,)
        self.rows_per_block = self.threads // g * per_group
        per_sm = gather_config.blocks_per_sm if on_host else gather_config.device_blocks_per_sm
        self.max_blocks = kernels.multiprocessor_count(device) * per_sm
        self.device = device
        self.on_host = on_host
        self.fn = _launch.function(name, all_modes)
        self.cu_fn = getattr(self.fn, "ptr", None)
        self.static = (row_stride, row_bytes, g)
        self.args = (ctypes.c_uint64 * _SLOTS)()
        base = ctypes.addressof(self.args)
        self.params = (ctypes.c_void_p * _SLOTS)(*(base + 8 * i for i in range(_SLOTS)))
        self.params_ptr = ctypes.addressof(self.params)
        cp = _cpointer()
        self.packed = tuple(cp(base + 8 * i) for i in range(_SLOTS)) if cp is not None else None
        self.lock = threading.Lock()

    def launch(self, table_ptr: int, n_rows: int, idx_ptr: int, order_ptr: int, m: int, dev_ptr: int,
               flag_ptr: int, ref: _StreamRef) -> None:
        """Queue the kernel on stream ``ref``: rows ``idx`` (visited through ``order``) <-> the rows at ``dev_ptr``."""
        blocks = -(-m // self.rows_per_block)
        if blocks > self.max_blocks:
            blocks = self.max_blocks
        stride, row_bytes, g = self.static
        if order_ptr and self.on_host:  # a sorted visit: keep the rows in flight near each other
            blocks = _launch.window_blocks(blocks, self.rows_per_block, m, n_rows * stride, row_bytes)
        with self.lock:
            _PACK.pack_into(self.args, 0, table_ptr, n_rows, stride, row_bytes, idx_ptr, order_ptr, m, dev_ptr, g,
                            flag_ptr)
            cu = None if LAUNCHER != "ctypes" or self.cu_fn is None else _cu_launch()
            if cu is not None:
                rc = cu(self.cu_fn, blocks, 1, 1, self.threads, 1, 1, 0, ref.ptr, self.params_ptr, None)
                if rc == _CUDA_ERROR_INVALID_CONTEXT:  # a thread without a current context yet: a runtime
                    torch.cuda.current_stream(self.device).query()  # call binds the device's primary context
                    rc = cu(self.cu_fn, blocks, 1, 1, self.threads, 1, 1, 0, ref.ptr, self.params_ptr, None)
                if rc != 0:
                    raise RuntimeError(f"cuLaunchKernel of the row kernel failed with CUDA error {rc}")
                return
            if self.packed is not None:
                try:
                    self.fn((blocks,), self.block, self.packed, 0, ref)
                    return
                except TypeError:  # this CuPy wants plain values
                    self.packed = None
            vals = list(self.args)
            self.fn((blocks,), self.block, tuple(np.int32(v) if i == 8 else np.uint64(v) for i, v in enumerate(vals)),
                    0, ref)


_plans: dict[tuple, RowPlan] = {}


def plan_for(direction: str, idx_dtype: torch.dtype, mode_id: int, device: int, on_host: bool, row_bytes: int,
             row_stride: int, w: int) -> RowPlan:
    """The cached `RowPlan` of this geometry (made on first use)."""
    cfg = gather_config
    key = (direction, idx_dtype, mode_id, device, on_host, row_bytes, row_stride, w, cfg.threads_per_block,
           cfg.blocks_per_sm if on_host else cfg.device_blocks_per_sm)
    plan = _plans.get(key)
    if plan is None:
        name = f"{direction}_w{w}_m{mode_id}_{'i32' if idx_dtype == torch.int32 else 'i64'}"
        plan = _plans[key] = RowPlan(name, mode_id != 2, row_bytes, row_stride, w, mode_id, device, on_host)
    return plan


def word_width(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) dividing every value (sizes, strides, addresses)."""
    a = 0
    for v in values:
        a |= v
    return 16 if not a & 15 else 8 if not a & 7 else 4 if not a & 3 else 2 if not a & 1 else 1


class HostTable:
    """A host table tensor's row layout, its plans, and what keeps its memory alive behind its launches."""

    __slots__ = ("ptr", "shape", "stride", "rest", "dtype", "n_rows", "row_bytes", "row_stride", "table_bytes", "w",
                 "storage", "streams", "events", "plans", "__weakref__")

    def __init__(self, data: torch.Tensor, row_bytes: int, row_stride: int) -> None:
        self.ptr = data.data_ptr()
        self.shape, self.stride = data.shape, data.stride()
        self.rest, self.dtype = data.shape[1:], data.dtype
        self.n_rows = data.shape[0]
        self.row_bytes, self.row_stride = row_bytes, row_stride
        self.table_bytes = self.n_rows * row_stride
        self.w = word_width(row_bytes, row_stride, self.ptr)
        self.storage = data.untyped_storage()
        self.streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self.events: list[torch.cuda.Event] = []
        self.plans: dict[tuple, RowPlan] = {}

    def plan(self, direction: str, idx_dtype: torch.dtype, mode_id: int, device: int, w: int) -> RowPlan:
        key = (direction, idx_dtype, mode_id, device, w, gather_config.blocks_per_sm, gather_config.threads_per_block)
        p = self.plans.get(key)
        if p is None:
            p = self.plans[key] = plan_for(direction, idx_dtype, mode_id, device, True, self.row_bytes,
                                           self.row_stride, w)
        return p

    def busy(self) -> bool:
        """True while a launch queued before the table was freed may still be running."""
        return any(not e.query() for e in self.events)


_tables_lock = threading.Lock()
_tables: dict[int, HostTable] = {}
retiring: list[HostTable] = []


def _retire(key: int, rec: HostTable) -> None:
    """The table tensor is being freed: hold its storage until the launches queued on it have finished."""
    with _tables_lock:
        if _tables.get(key) is rec:
            del _tables[key]
    _park(rec)


def _park(rec: HostTable) -> None:
    for stream in list(rec.streams.values()):  # an event behind everything queued there, ours included
        ev = torch.cuda.Event()
        ev.record(stream)
        rec.events.append(ev)
    if rec.busy():
        with _tables_lock:
            retiring.append(rec)


def _drop_finished() -> None:
    with _tables_lock:
        retiring[:] = [r for r in retiring if r.busy()]


def known_host_table(data: torch.Tensor) -> HostTable | None:
    """The `HostTable` of host tensor ``data`` if one was made and still describes it, else None."""
    rec = _tables.get(id(data))
    if rec is not None and rec.ptr == data.data_ptr() and rec.shape == data.shape:
        return rec
    return None


def host_table(data: torch.Tensor) -> HostTable | None:
    """The `HostTable` of host tensor ``data`` (made on first use); None when its rows are not contiguous."""
    rec = known_host_table(data)
    if rec is not None:
        return rec
    key = id(data)
    layout = _launch.row_layout(data)
    if layout is None:
        return None
    if retiring:
        _drop_finished()
    fresh = HostTable(data, *layout)
    with _tables_lock:
        old = _tables.get(key)
        _tables[key] = fresh
    if old is not None:  # the same tensor object now over other memory or shape (set_, resize_)
        _park(old)
    fin = weakref.finalize(data, _retire, key, fresh)
    fin.atexit = False
    return fresh


def pending_host_tables() -> int:
    """How many freed host tables are still held because a launch on them may be running."""
    _drop_finished()
    return len(retiring)
