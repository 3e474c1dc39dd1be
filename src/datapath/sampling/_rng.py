"""The counter-based random numbers shared by the CPU sampler and the CUDA kernel (``kernels/sample.cu``).

Every random draw is a pure function of ``(key, node, step)``:
``mix64(mix64(key ^ node) ^ step)`` with SplitMix64's finalizer ``mix64``.  The
CPU path (numpy, vectorized) and the GPU kernel compute the same bits, so a
sample is reproducible across devices, thread counts and batch orders.

A draw ``r`` becomes an integer in ``[0, n)`` as ``((r >> 32) * n) >> 32``
(Lemire's multiply-shift; bias below ``n / 2**32``, nil for graph degrees).
"""
from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def mix64_int(z: int) -> int:
    """SplitMix64's step on a Python int (64-bit wrap)."""
    z = (z + GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def derive_key(seed: int, step: int, layer: int) -> int:
    """The 64-bit key of one sampling call: hop ``layer`` of batch number ``step`` under ``seed``."""
    k = mix64_int(seed & _M64)
    k = mix64_int(k ^ (step & _M64))
    return mix64_int(k ^ (layer & _M64))


def mix64(z: np.ndarray) -> np.ndarray:
    """Vectorized SplitMix64 step on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
        return z ^ (z >> np.uint64(31))


def node_state(key: int, nodes: np.ndarray) -> np.ndarray:
    """Per-node stream state ``mix64(key ^ node)``: (n,) uint64 for (n,) int64 node ids."""
    return mix64(np.uint64(key) ^ nodes.astype(np.uint64, copy=False))


def draw_below(state: np.ndarray, step: int | np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Integers in ``[0, bound)`` for draw number ``step`` of each node's stream: (n,) int64."""
    r = mix64(state ^ np.asarray(step, dtype=np.uint64))
    with np.errstate(over="ignore"):
        hi = r >> np.uint64(32)
        return ((hi * bound.astype(np.uint64, copy=False)) >> np.uint64(32)).astype(np.int64)
