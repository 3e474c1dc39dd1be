"""The analytical launch model of the CUDA aggregation kernels (GNNAdvisor §6), inspectable and overridable.

The kernel maps one *neighbor group* (up to ``ngs`` consecutive neighbors of one
destination row) to a team of ``dw`` lanes (*dimension workers*) of one warp; each lane
reads ``vec`` consecutive feature elements per load (16-byte loads where the row width
allows), so a team covers ``dw * vec`` columns per pass and ``ceil(F / (dw*vec))``
passes cover a row.  Teams of a block combine the partial sums of groups of the same row
in shared memory; one team (the leader) writes each row, atomically only when the row's
groups span several blocks.

The model, after GNNAdvisor's eq. 5-6 adapted to vector loads:

- ``vec``: the widest load (16 bytes / element size, then halving) that divides ``F``;
- ``dw``: ``min(32, next_pow2(F / vec))`` lanes, so a team covers a row in one pass when
  the row is narrow and a full warp works on wide rows (eq. 6: ``dw = tpw`` when ``Dim >= tpw``);
- ``ngs``: work per thread ``WPT = ngs * passes`` (vector loads per lane) near
  ``WPT_TARGET``, between 2 and 32, and no larger than needed for the average degree;
- ``threads_per_block``: 128 (4 warps; GNNAdvisor found 1-4 warps best), shared memory
  ``SMEM = threads_per_block * vec * 4`` bytes (one fp32 accumulator slice per lane).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from datapath.ops._graph import as_csr

WPT_TARGET = 64
"""Vector loads per lane per neighbor group that the model aims at."""

BACKWARD_MODES = ("transpose", "atomic")
FUSED_MODES = ("auto", "push", "pull")


@dataclass(frozen=True)
class AggregationPlan:
    """Launch parameters of the aggregation kernels for one graph and feature width.

    Attributes:
        feat_dim: F, feature columns per row.
        elem_bytes: bytes per feature element.
        vec: elements per vector load (1, 2, 4 or 8).
        dw: dimension workers: lanes per neighbor group (a power of two <= 32).
        ngs: neighbor-group size: neighbors one team aggregates.
        threads_per_block: threads per CUDA block (a multiple of 32).
        work_per_thread: ``ngs * passes`` vector loads per lane per group (the model's WPT).
        shared_mem_bytes: shared memory per block for the partial sums.
        backward: gradient of x via the cached ``"transpose"`` CSR (no atomics) or ``"atomic"`` scatter.
        fused: with ``src_ids`` over a host table: ``"push"`` reads every source row once and scatters
            it (transposed block, atomics in GPU memory), ``"pull"`` reads a row per edge; ``"auto"``
            picks push for host tables and pull for GPU tables.
    """

    feat_dim: int
    elem_bytes: int
    vec: int
    dw: int
    ngs: int
    threads_per_block: int
    work_per_thread: int
    shared_mem_bytes: int
    backward: str = "transpose"
    fused: str = "auto"

    @property
    def passes(self) -> int:
        """Column passes a team makes over a row: ``ceil(F / (dw * vec))``."""
        return -(-self.feat_dim // (self.dw * self.vec))

    @property
    def teams_per_block(self) -> int:
        return self.threads_per_block // self.dw

    def replace(self, **changes: Any) -> AggregationPlan:
        """A copy with ``changes`` applied (e.g. ``plan.replace(ngs=8)``), re-checked."""
        p = dataclasses.replace(self, **changes)
        p.check()
        return dataclasses.replace(
            p, work_per_thread=p.ngs * p.passes, shared_mem_bytes=p.threads_per_block * p.vec * 4
        )

    def check(self) -> None:
        """Raise ValueError when a field is out of the kernels' range."""
        if self.dw not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"dw must be a power of two <= 32, got {self.dw}")
        if self.vec not in (1, 2, 4, 8) or self.vec * self.elem_bytes > 16:
            raise ValueError(f"vec must be 1, 2, 4 or 8 with vec * elem_bytes <= 16, got {self.vec}")
        if self.feat_dim % self.vec:
            raise ValueError(f"vec={self.vec} must divide the feature width {self.feat_dim}")
        if not 1 <= self.ngs <= 1024:
            raise ValueError(f"ngs must lie in [1, 1024], got {self.ngs}")
        if self.threads_per_block % 32 or not 32 <= self.threads_per_block <= 1024:
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, 1024], got "
                             f"{self.threads_per_block}")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES}, got {self.fused!r}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_for(num_edges: int, num_dst: int, feat_dim: int, elem_bytes: int, **overrides: Any) -> AggregationPlan:
    """The model's plan from the graph's size and the row width (see the module docstring)."""
    if feat_dim < 1:
        raise ValueError(f"feature width must be >= 1, got {feat_dim}")
    vec = max(1, 16 // elem_bytes)
    while feat_dim % vec:
        vec //= 2
    nv = feat_dim // vec
    dw = min(32, _next_pow2(nv))
    passes = -(-nv // dw)
    avg_deg = num_edges / max(num_dst, 1)
    ngs = max(2, min(32, WPT_TARGET // passes))
    ngs = max(2, min(ngs, _next_pow2(max(1, int(avg_deg * 2)))))
    tpb = 128
    plan = AggregationPlan(
        feat_dim=feat_dim, elem_bytes=elem_bytes, vec=vec, dw=dw, ngs=ngs, threads_per_block=tpb,
        work_per_thread=ngs * passes, shared_mem_bytes=tpb * vec * 4,
    )
    return plan.replace(**overrides) if overrides else plan


def plan_aggregation(graph: Any, feat_dim: int, dtype: torch.dtype = torch.float32,
                     **overrides: Any) -> AggregationPlan:
    """The launch plan the CUDA kernels use for ``graph`` at width ``feat_dim`` (pure arithmetic, no GPU).

    Keyword overrides (``ngs=``, ``dw=``, ``vec=``, ``threads_per_block=``, ``backward=``, ``fused=``)
    replace the model's choices; pass the result as ``aggregate(..., plan=plan)``.
    """
    csr = as_csr(graph)
    elem = torch.empty((), dtype=dtype).element_size()
    return plan_for(csr.num_edges, csr.num_dst, feat_dim, elem, **overrides)
