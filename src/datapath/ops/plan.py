"""Which kernel aggregates a graph, and with which launch parameters: `AggregationPlan` and its model.

Four implementations of the sum/mean/GCN aggregation run on CUDA:

``"rows"``
    row split with coalesced row caching (GE-SpMM): a team of ``dw`` lanes per (row,
    column chunk) walks the row's edges, each lane ``cf`` vectors of ``vec`` columns wide;
    rows longer than ``cut`` edges get a team per piece of ``cut`` edges, in the same launch,
    whose sums meet in a float32 buffer.  Results are stored directly (no zeroing pass, no
    atomics on ordinary rows).  Teams may take rows by
    descending length (``row_order``: a warp's teams then finish together), a column strip
    of every row at a time (``sweep``: L2 reuse on tables larger than L2), or several short
    rows each (``rows_per_team``: loads in flight across row ends).
``"groups"``
    GNNAdvisor: neighbor groups of at most ``ngs`` edges, ``dw`` dimension workers per group,
    partial sums of a row combined in shared memory (its analytical model, eq. 5-6, below).
``"tensor_core"``
    TC-GNN: the rows cut into 16-row windows whose distinct neighbours are condensed into
    16 x 16 (half, bfloat16) or 16 x 8 (tf32) tiles multiplied with ``mma.sync``.  For float16
    and bfloat16, and for float32 when ``torch.backends.cuda.matmul.allow_tf32`` is set.
``"cusparse"``
    ``torch.sparse.mm`` with a CSR matrix built once per graph (cuSPARSE SpMM).

The model (`plan_for`) picks ``rows`` and its parameters from the graph's size and the row
width alone (no GPU work).  For a graph the ops checked themselves (not ``trusted``: a
whole graph rather than a sampled block) the first call of each (width, dtype, variant)
also times every applicable kernel once on the call's own input (a short probe, a
synchronisation once per graph) and keeps the fastest; `plan_aggregation(..., probe=True)`
does the same ahead of time.  The choice is cached with the graph.

GNNAdvisor's model for ``groups``, adapted to vector loads:

- ``vec``: the widest load (16 bytes / element size, then halving) that divides ``F``;
- ``dw``: ``min(32, next_pow2(F / vec))`` lanes, so a team covers a row in one pass when
  the row is narrow and a full warp works on wide rows (eq. 6: ``dw = tpw`` when ``Dim >= tpw``);
- ``ngs``: work per thread ``WPT = ngs * passes`` (vector loads per lane) near
  ``WPT_TARGET``, between 2 and 32, and no larger than needed for the average degree;
- ``threads_per_block``: 128 (4 warps), shared memory ``threads_per_block * vec * 4`` bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

WPT_TARGET = 64
"""Vector loads per lane per neighbor group that the GNNAdvisor model aims at."""

KERNELS = ("rows", "groups", "tensor_core", "cusparse")
BACKWARD_MODES = ("transpose", "atomic")
FUSED_MODES = ("auto", "push", "pull")
ROW_ORDERS = ("natural", "degree")
SWEEPS = ("rows", "columns")
ROW_CUT = 128
"""Edges one ``rows`` team aggregates before the rest of a long row goes to extra teams."""


@dataclass(frozen=True)
class AggregationPlan:
    """The kernel and launch parameters of an aggregation for one graph and feature width.

    Attributes:
        feat_dim: F, feature columns per row.
        elem_bytes: bytes per feature element.
        vec: elements per vector load (1, 2, 4 or 8).
        dw: lanes per team (``rows``: per row and column chunk; ``groups``: per neighbor group).
        ngs: ``groups``: neighbor-group size.
        threads_per_block: threads per CUDA block (a multiple of 32).
        work_per_thread: ``groups``: ``ngs * passes`` vector loads per lane per group.
        shared_mem_bytes: ``groups``: shared memory per block for the partial sums.
        backward: gradient of x over the cached transposed CSR (``"transpose"``, with a plan of
            its own) or by atomic scatter over this one (``"atomic"``).
        fused: with ``src_ids`` over a host table: ``"push"`` reads every source row once and
            scatters it, ``"pull"`` reads a row per edge; ``"auto"``: push for host tables.
        kernel: one of `KERNELS`.
        cf: ``rows``: column vectors per lane (1, 2 or 4).
        cut: ``rows``: edges per team before a long row is split.
        nt: ``tensor_core``: 8-column tiles per warp (1, 2 or 4).
        unroll: ``rows``: neighbours per unrolled step (0: ``4 / cf``, four vector loads in flight).
        row_order: ``rows``: the order teams take rows in: ``"natural"`` (as stored) or ``"degree"``
            (by descending length, sorted once per graph: the teams sharing a warp get rows of like
            length, and long rows start first).
        sweep: ``rows`` with several column chunks per row: ``"rows"`` (a row's chunks together) or
            ``"columns"`` (every row's first chunk, then every row's second...: the blocks running at
            once read one column strip of the table, which L2 may hold where the whole table does not).
        rows_per_team: ``rows``: consecutive rows a team takes (> 1: their edges walked as one run,
            loads in flight across row ends, for graphs of short rows; every edge of a row, no
            ``cut``; stored row order only).
        probed_ms: forward time measured by the probe that chose this plan (None: the model's pick).
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
    kernel: str = "rows"
    cf: int = 1
    cut: int = ROW_CUT
    nt: int = 2
    unroll: int = 0
    row_order: str = "natural"
    sweep: str = "rows"
    rows_per_team: int = 1
    probed_ms: float | None = None

    @property
    def passes(self) -> int:
        """Column passes a ``groups`` team makes over a row: ``ceil(F / (dw * vec))``."""
        return -(-self.feat_dim // (self.dw * self.vec))

    @property
    def chunks(self) -> int:
        """``rows``: column chunks per row (teams per row): ``ceil(F / (dw * vec * cf))``."""
        return -(-self.feat_dim // (self.dw * self.vec * self.cf))

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
        """Raise ValueError naming the field that is out of the kernels' range."""
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
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
        if self.cf not in (1, 2, 4):
            raise ValueError(f"cf must be 1, 2 or 4, got {self.cf}")
        if self.cut < 1:
            raise ValueError(f"cut must be >= 1, got {self.cut}")
        if self.nt not in (1, 2, 4):
            raise ValueError(f"nt must be 1, 2 or 4, got {self.nt}")
        if self.unroll not in (0, 1, 2, 4, 8):
            raise ValueError(f"unroll must be 0 (default), 1, 2, 4 or 8, got {self.unroll}")
        if self.row_order not in ROW_ORDERS:
            raise ValueError(f"row_order must be one of {ROW_ORDERS}, got {self.row_order!r}")
        if self.sweep not in SWEEPS:
            raise ValueError(f"sweep must be one of {SWEEPS}, got {self.sweep!r}")
        if not 1 <= self.rows_per_team <= 64:
            raise ValueError(f"rows_per_team must lie in [1, 64], got {self.rows_per_team}")
        if self.rows_per_team > 1 and self.row_order != "natural":
            raise ValueError("rows_per_team > 1 walks consecutive rows: it takes row_order='natural', not "
                             f"{self.row_order!r}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def widest_vec(feat_dim: int, elem_bytes: int) -> int:
    """The widest vector (elements, at most 16 bytes) that divides ``feat_dim``."""
    vec = max(1, 16 // elem_bytes)
    while feat_dim % vec:
        vec //= 2
    return vec


def plan_for(num_edges: int, num_dst: int, feat_dim: int, elem_bytes: int, **overrides: Any) -> AggregationPlan:
    """The model's plan from the graph's size and the row width (see the module docstring)."""
    if feat_dim < 1:
        raise ValueError(f"feature width must be >= 1, got {feat_dim}")
    vec = widest_vec(feat_dim, elem_bytes)
    nv = feat_dim // vec
    dw = min(32, _next_pow2(nv))
    passes = -(-nv // dw)
    avg_deg = num_edges / max(num_dst, 1)
    ngs = max(2, min(32, WPT_TARGET // passes))
    ngs = max(2, min(ngs, _next_pow2(max(1, int(avg_deg * 2)))))
    tpb = 128
    cf = 2 if nv > 32 else 1
    nt = 4 if feat_dim >= 128 else 2 if feat_dim > 8 else 1
    plan = AggregationPlan(
        feat_dim=feat_dim, elem_bytes=elem_bytes, vec=vec, dw=dw, ngs=ngs, threads_per_block=tpb,
        work_per_thread=ngs * passes, shared_mem_bytes=tpb * vec * 4, cf=cf, nt=nt,
    )
    return plan.replace(**overrides) if overrides else plan


def plan_aggregation(graph: Any, feat_dim: int, dtype: torch.dtype = torch.float32, reduce: str = "sum", *,
                     probe: bool = False, edge_weight: bool = False, norm: str | None = None,
                     kernels: tuple[str, ...] | None = None, **overrides: Any) -> AggregationPlan:
    """The plan `aggregate` uses for ``graph`` at width ``feat_dim``.

    Without ``probe``: the model's plan (pure arithmetic, no GPU work) with keyword
    overrides (``kernel=``, ``ngs=``, ``dw=``, ``vec=``, ``cf=``, ``cut=``, ``nt=``, ``unroll=``,
    ``row_order=``, ``sweep=``, ``rows_per_team=``, ``threads_per_block=``, ``backward=``,
    ``fused=``) applied; pass it as ``aggregate(..., plan=plan)`` to force it.

    With ``probe=True`` (a CUDA graph): every applicable kernel is timed on random rows of
    ``dtype`` and the fastest becomes ``graph``'s plan for this width, dtype, ``reduce``,
    ``norm`` and ``edge_weight`` (whether the calls pass one), forward and backward (the
    transposed CSR gets its own); later `aggregate` calls use it without probing again.
    ``kernels`` (with ``probe=True``) limits the probe to those of `KERNELS` (e.g. ``("cusparse",)``
    to keep the library); a ValueError if none of them can run this aggregation.
    """
    from datapath.ops._graph import as_csr  # noqa: PLC0415

    csr = as_csr(graph)
    elem = torch.empty((), dtype=dtype).element_size()
    if kernels is not None:
        bad = [k for k in kernels if k not in KERNELS]
        if not probe or bad or not kernels:
            raise ValueError(f"kernels lists kernels for probe=True to time, some of {KERNELS}; got {kernels!r} "
                             f"with probe={probe}")
    if not probe:
        if not overrides:  # the model's plan for this graph (it may know the graph's longest row)
            from datapath.ops._tune import model_plan  # noqa: PLC0415

            return model_plan(csr, feat_dim, dtype, 1)
        return plan_for(csr.num_edges, csr.num_dst, feat_dim, elem, **overrides)
    if overrides:
        raise ValueError("plan_aggregation: pass either probe=True or overrides, not both")
    if csr.device.type != "cuda":
        raise ValueError(f"probe=True times the CUDA kernels; the graph is on {csr.device}")
    from datapath.ops._tune import tune_graph  # noqa: PLC0415

    return tune_graph(csr, feat_dim, dtype, reduce, norm, edge_weight, kernels)
