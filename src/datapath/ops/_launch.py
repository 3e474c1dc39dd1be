"""Kernel launches with as little host work as possible: the aggregation's fixed cost per call.

The launch path itself is `datapath._runtime.launch`, the one shared with `datapath.memory`: each
variant's CuPy ``Function`` looked up once per (source, name, options), launched on PyTorch's
current stream directly (no stream context switch per call), and `PackedLaunch`, which keeps a
launch's arguments in one numpy buffer that CuPy is handed pointers into, so a call writes only
the pointers that change instead of converting every argument.  Here: the aggregation kernels'
compile options and vector widths.
"""
from __future__ import annotations

import torch

from datapath._runtime.launch import NULL, PackedLaunch, function, launch, ptr
from datapath._runtime.launch import stream_ref as current_stream

__all__ = ["KIND", "NULL", "PackedLaunch", "aligned_vec", "current_stream", "function", "launch", "options", "ptr"]

KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def options(dtype: torch.dtype, vec: int, idx_dtype: torch.dtype, *extra: str) -> tuple[str, ...]:
    opts = [f"-DDP_KIND={KIND[dtype]}", f"-DDP_VEC={vec}"]
    if idx_dtype == torch.int64:
        opts.append("-DDP_IDX_64")
    return (*opts, *extra)


def aligned_vec(vec: int, feat: int, elem: int, *tensors: torch.Tensor | None) -> int:
    """``vec`` narrowed until it divides ``feat`` and every tensor's base address is aligned to it."""
    while vec > 1 and (feat % vec or any(t is not None and t.data_ptr() % (vec * elem) for t in tensors)):
        vec //= 2
    return vec
