"""Launching the row kernels of ``kernels/gather.cu``: word width, lanes per row, grid.

Private to `datapath.memory`; `datapath.memory.rows` decides what to launch, and
`datapath.memory._plans` caches the plain kernels' launches per row geometry.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels, launch
from datapath.memory import _order
from datapath.memory.config import check_env, gather_config

_WIDTHS = (16, 8, 4, 2, 1)
_LINE = 128
_ALL_MODES = ("-DDP_ALL_MODES",)


def function(name: str, all_modes: bool, options: tuple[str, ...] = ()) -> Any:
    """The compiled row kernel ``name`` of ``gather.cu`` (a CuPy ``Function``), loaded once per device (and extra
    compiler options), through the one launch path (`datapath._runtime.launch`)."""
    return launch.function("gather.cu", name, (*(_ALL_MODES if all_modes else ()), *options),
                           torch.cuda.current_device())


def row_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(row_bytes, row_stride_bytes) of ``t`` (N, *rest) if each row is contiguous in memory, else None."""
    if t.dim() == 0:
        return None
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    es = t.element_size()
    return expected * es, t.stride(0) * es


def word_bytes(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) dividing every value (sizes, strides, addresses)."""
    for w in _WIDTHS:
        if all(v % w == 0 for v in values):
            return w
    return 1


def lanes_and_rows(words: int, w: int, mode: int) -> tuple[int, int]:
    """(lanes per row G, rows a group moves per iteration) as the kernel chooses them."""
    g = 32 if words >= 32 else 1 << max(0, (words - 1).bit_length())
    span = words + _LINE // w - 1 if mode == 1 else words
    steps = -(-span // g)
    return g, 4 if steps == 1 else 2 if steps == 2 else 1


def _grid(m: int, g: int, rows_per_group: int, device: int, on_host: bool) -> int:
    check_env()  # a bad DATAPATH_GATHER_* variable: one line naming it, here rather than at import
    groups_per_block = gather_config.threads_per_block // g
    per_sm = gather_config.blocks_per_sm if on_host else gather_config.device_blocks_per_sm
    max_blocks = kernels.multiprocessor_count(device) * per_sm
    return max(1, min(-(-m // (groups_per_block * rows_per_group)), max_blocks))


def window_blocks(blocks: int, rows_per_block: int, m: int, table_bytes: int, row_bytes: int) -> int:
    """The grid of a sorted gather of ``m`` rows from a host table: at most ``blocks``, fewer where rows are sparse.

    A grid-stride kernel keeps about ``blocks * rows_per_block`` consecutive rows of the
    visit in flight; they span ``table_bytes / m`` table bytes each.  Random rows of a large
    table are limited by address translation, and a window of rows in flight spanning more
    than ``gather_config.host_window_bytes`` of the table misses the GPU's translation
    caches: the grid shrinks to that span, keeping at least ``host_min_inflight_bytes`` in
    flight (PCIe latency).  Rows of ``gather_config.sort_max_row_bytes`` or more keep the
    full grid (see `GatherConfig`).
    """
    window = gather_config.host_window_bytes
    if window <= 0 or m <= 0 or row_bytes >= gather_config.sort_max_row_bytes:
        return blocks
    rows = max(window * m / max(table_bytes, 1), gather_config.host_min_inflight_bytes / max(row_bytes, 1))
    return max(1, min(blocks, -(-int(rows) // rows_per_block)))


def launch_tiered(a: torch.Tensor, b: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, *, sort: bool,
                  flag_ptr: int, counts: torch.Tensor | None, b_on_host: bool) -> None:
    """``out[k] = row of slot loc[k]`` from tables ``a`` (slots 1..len(a)) and ``b`` (the next len(b)).

    ``a``/``b``: (rows, F...) with contiguous rows (either may have 0 rows); ``loc``: (m,) int32
    CUDA; slots < 0 are skipped, slot 0 gives zeros; ``out`` (m, F...) contiguous CUDA;
    ``counts``: optional (3,) int64 CUDA accumulating rows taken from a, from b, skipped.
    """
    m = loc.numel()
    if m == 0:
        return
    row_bytes = out[0].numel() * out.element_size() if out.dim() > 1 else out.element_size()
    la = row_layout(a) or (row_bytes, row_bytes)
    lb = row_layout(b) or (row_bytes, row_bytes)
    ptrs = [t.data_ptr() for t in (a, b) if t.numel()]
    w = word_bytes(row_bytes, la[1], lb[1], out.data_ptr(), *ptrs)
    g, per_group = lanes_and_rows(row_bytes // w, w, 2)
    dev = loc.device.index
    on_host = b_on_host and b.shape[0] > 0
    blocks = _grid(m, g, per_group, dev, on_host)
    if sort:
        visit = _order.sorted_visit(loc, a.shape[0] + b.shape[0] + 1)
        keys_ptr, order_ptr = visit[1], visit[2]
    else:
        keys_ptr, order_ptr = loc.data_ptr(), 0
    if order_ptr and on_host:
        blocks = window_blocks(blocks, gather_config.threads_per_block // g * per_group, m, b.shape[0] * lb[1],
                               row_bytes)
    stream = torch.cuda.current_stream(loc.device)
    function(f"tiered_gather_w{w}", False)(
        (blocks,), (gather_config.threads_per_block,),
        (kernels.ptr(a if a.numel() else 0), np.int64(la[1]), np.int64(a.shape[0]),
         kernels.ptr(b if b.numel() else 0), np.int64(lb[1]), np.int64(b.shape[0]),
         kernels.ptr(keys_ptr), kernels.ptr(order_ptr), np.int64(m), kernels.ptr(out),
         np.int64(row_bytes), np.int32(g), np.uint64(flag_ptr), kernels.ptr(0 if counts is None else counts)),
        0, launch.StreamRef(stream.cuda_stream))
