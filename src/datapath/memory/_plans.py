"""Launch plans of the row kernels, and keeping host tables alive behind their launches; no waiting anywhere.

Private to `datapath.memory`.

`RowPlan`: what a launch needs that depends only on the row geometry (direction, index
dtype, alignment scheme, device, row size and stride, word width, grid settings): the
compiled kernel, the lanes per row, the grid limit, and its `kernels.DriverLaunch`: one
buffer holding the launch configuration and the ten kernel arguments, packed by one
``struct.pack_into`` per call and handed to ``cuLaunchKernelEx`` (the default: the
cheapest launch from Python, measured), or read by CuPy's launcher
(``gather_config.launcher = "cupy"``, and where the driver has no ``cuLaunchKernelEx``).

`FastGather`: what `datapath.memory.rows`' most common call (a known host table, 1-D CUDA
indices on the current device and stream) needs: the plan, the output's dtype template,
and from how many rows the call sorts its indices; the table's last one is tried first.

`HostTable`: one record per host table tensor, made on its first fetch: its row layout
(so a call does not work it out again), its plans, and the streams its launches were
queued on.  A kernel over host memory runs after the call returns, so the memory must
outlive it: the record holds the table's storage, and when the table tensor dies it
records one event on each of those streams (behind every launch queued there) and keeps
the storage (`retiring`) until they have completed; the next new record drops what has.
No per-call event, no waiting.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels, launch, native
from datapath.memory import _launch
from datapath.memory.config import GATHER_MODES, gather_config

# the kernel arguments: table, n_rows, row_stride, row_bytes, idx, order, n_idx, dev, G, err (G an int, 8 bytes
# here: the driver reads the low four of a little-endian word)
_ARGS = "QqqqQQqQqQ"


_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: int) -> tuple[tuple[int, int], torch.cuda.Stream]:
    """(key = (device, raw handle), PyTorch's object) of ``device``'s current stream, the object made once per key.

    (The default stream's handle is 0 on every device.)
    """
    key = (device, torch._C._cuda_getCurrentRawStream(device))  # noqa: SLF001 - 0.2 us instead of 2 us
    s = _streams.get(key)
    if s is None:
        s = _streams[key] = torch.cuda.current_stream(device)
    return key, s


class RowPlan:
    """The launch of ``{gather,scatter}_w{W}_m{MODE}_{i32,i64}`` for one row geometry, worked out once.

    Attributes:
        rows_per_block, max_blocks: the grid is ``min(ceil(m / rows_per_block), max_blocks)``.
    """

    __slots__ = ("rows_per_block", "max_blocks", "threads", "block", "fn", "driver", "packed", "static", "device",
                 "on_host")

    def __init__(self, name: str, all_modes: bool, row_bytes: int, row_stride: int, w: int, mode_id: int,
                 device: int, on_host: bool, options: tuple[str, ...] = ()) -> None:
        g, per_group = _launch.lanes_and_rows(row_bytes // w, w, mode_id)
        self.threads = gather_config.threads_per_block
        self.block = (self.threads,)
        self.rows_per_block = self.threads // g * per_group
        per_sm = gather_config.blocks_per_sm if on_host else gather_config.device_blocks_per_sm
        self.max_blocks = kernels.multiprocessor_count(device) * per_sm
        self.device = device
        self.on_host = on_host
        self.fn = _launch.function(name, all_modes, options)
        self.static = (row_stride, row_bytes, g)
        self.driver = kernels.DriverLaunch(self.fn, _ARGS, self.threads, device)
        cp = launch.cpointer()
        self.packed = tuple(cp(a) for a in self.driver.arg_ptrs) if cp is not None else None

    def launch_plain(self, table_ptr: int, n_rows: int, idx_ptr: int, m: int, dev_ptr: int, flag_ptr: int,
                     stream: int) -> None:
        """`launch` of rows in the caller's order (the shortest way to the GPU)."""
        blocks = -(-m // self.rows_per_block)
        if blocks > self.max_blocks:
            blocks = self.max_blocks
        stride, row_bytes, g = self.static
        if gather_config.launcher != "cupy" and self.driver.available:
            self.driver.launch(blocks, stream, table_ptr, n_rows, stride, row_bytes, idx_ptr, 0, m, dev_ptr, g,
                               flag_ptr)
        else:
            self._launch_cupy(blocks, stream, table_ptr, n_rows, stride, row_bytes, idx_ptr, 0, m, dev_ptr, g,
                              flag_ptr)

    def launch(self, table_ptr: int, n_rows: int, idx_ptr: int, order_ptr: int, m: int, dev_ptr: int,
               flag_ptr: int, stream: int) -> None:
        """Queue the kernel on the raw CUDA stream ``stream``: rows ``idx`` (visited through ``order``) <-> the
        rows at ``dev_ptr``."""
        blocks = -(-m // self.rows_per_block)
        if blocks > self.max_blocks:
            blocks = self.max_blocks
        stride, row_bytes, g = self.static
        if order_ptr and self.on_host:  # a sorted visit: keep the rows in flight near each other
            blocks = _launch.window_blocks(blocks, self.rows_per_block, m, n_rows * stride, row_bytes)
        args = (table_ptr, n_rows, stride, row_bytes, idx_ptr, order_ptr, m, dev_ptr, g, flag_ptr)
        if gather_config.launcher != "cupy" and self.driver.available:
            self.driver.launch(blocks, stream, *args)
        else:
            self._launch_cupy(blocks, stream, *args)

    def _launch_cupy(self, blocks: int, stream: int, *args: int) -> None:
        """CuPy's launcher, reading the arguments packed in the driver launch's buffer."""
        ref = launch.StreamRef(stream)
        d = self.driver
        with d.lock:
            d.struct.pack_into(d.buf, 0, blocks, 1, 1, self.threads, 1, 1, 0, stream, 0, 0, *args)
            if self.packed is not None:
                try:
                    self.fn((blocks,), self.block, self.packed, 0, ref)
                    return
                except TypeError:  # this CuPy wants plain values
                    self.packed = None
            self.fn((blocks,), self.block,
                    tuple(np.int32(v) if i == 8 else np.uint64(v) for i, v in enumerate(d.values())), 0, ref)


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


_MAX_FAST = 64


PENDING = object()  # `FastGather.native` before the native launcher is built
NO_LIMIT = 1 << 62  # a row limit of the native gather that no call reaches


class FastGather:
    """The plain gather of a `HostTable` with 1-D indices of one dtype, on one device and stream, under one
    `gather_config` version (those four: ``dtype``, ``device``, ``stream``, ``version``): its plan, an empty
    tensor of the output's dtype on that device (``like.new_empty`` makes the output), the output rows' shape
    ``rest``, the row count from which a call that leaves ``sort`` out sorts its indices (``sort_limit``: the
    same as an int), ``waits`` (made under ``sync_bounds_check``: such calls wait, and take the general path),
    and ``native``: its plan for the native launcher (`datapath._runtime.native`; `PENDING` until that is
    built, None where it is not used)."""

    __slots__ = ("plan", "like", "rest", "sort_from", "sort_limit", "waits", "dtype", "device", "stream", "version",
                 "native")

    def __init__(self, plan: RowPlan, like: torch.Tensor, rest: tuple[int, ...], sort_from: float, key: tuple) -> None:
        self.plan, self.like, self.rest, self.sort_from = plan, like, rest, sort_from
        self.waits = gather_config.sync_bounds_check  # such calls wait for their bounds check: the general path
        self.sort_limit = int(min(sort_from, NO_LIMIT))
        self.dtype, self.device, self.stream, self.version = key
        self.native: Any = PENDING if gather_config.launcher == "native" and not self.waits else None


def native_plan(rec: "HostTable", fast: FastGather) -> Any:
    """``fast.native`` made once the native launcher is built; None while it builds (``fast.native`` stays
    `PENDING`) and where it cannot be.

    Made, it is the launcher's ``gather`` bound to a plan holding the table's address and the
    kernel's settings: ``fast.native(idx, flag_address, limit)`` returns the rows of ``idx``
    (1-D, contiguous, fewer than ``limit``), or None where the Python launch must run
    (`datapath._runtime.native_launch.cpp`).
    """
    mod = native.module()
    if mod is None:
        if native.status() != "building":
            fast.native = None
        return None
    plan = fast.plan
    launch = kernels.driver_entry("cuLaunchKernel")
    cu_fn = getattr(plan.fn, "ptr", 0)
    if not launch or not cu_fn:
        fast.native = None
        return None
    row_stride, row_bytes, g = plan.static
    capsule = mod.plain_gather(launch, cu_fn, fast.stream, rec.ptr, rec.n_rows, row_stride, row_bytes, plan.threads,
                               plan.rows_per_block, plan.max_blocks, g, rec.w,
                               torch.empty(0, dtype=fast.dtype, device=fast.device), fast.like, tuple(fast.rest))
    fast.native = functools.partial(mod.gather, capsule)
    return fast.native


class HostTable:
    """A host table tensor's row layout, its plans, and what keeps its memory alive behind its launches."""

    __slots__ = ("ptr", "shape", "stride", "rest", "dtype", "n_rows", "row_bytes", "row_stride", "table_bytes", "w",
                 "storage", "streams", "events", "plans", "fast", "last", "__weakref__")

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
        self.fast: dict[tuple, FastGather] = {}
        self.last: FastGather | None = None  # the one `rows.take_rows` tries first

    def fast_gather(self, key: tuple) -> FastGather:
        """The `FastGather` of ``key`` = (index dtype, device, raw stream, gather_config version), made on first use.

        Making one registers the stream with the table (its memory is kept until the work queued there is done).
        """
        fast = self.fast.get(key)
        if fast is None:
            if len(self.fast) >= _MAX_FAST:  # settings changed often, or many streams: start again
                self.fast.clear()
            idx_dtype, device, raw, _ = key
            cfg = gather_config
            plan = self.plan("gather", idx_dtype, GATHER_MODES[cfg.gather_mode], device, self.w)
            sort_from = 0.0 if cfg.sync_bounds_check else cfg.sort_from(self.row_bytes, self.table_bytes)
            stream_key = (device, raw)
            self.streams.setdefault(stream_key, current_stream(device)[1])
            fast = self.fast[key] = FastGather(plan, torch.empty(0, dtype=self.dtype, device=device),
                                               tuple(self.rest), sort_from, key)
        self.last = fast
        return fast

    def narrow_plan(self, fast: FastGather, out_ptr: int) -> RowPlan:
        """``fast``'s gather for an output at ``out_ptr``, less aligned than the table's word: a narrower word."""
        return self.plan("gather", fast.dtype, GATHER_MODES[gather_config.gather_mode], fast.device,
                         word_width(self.w, out_ptr))

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
