"""``aggregate``: SpMM-style neighbor aggregation over a CSR of destination rows, with autograd."""
from __future__ import annotations

from typing import Any

import torch

from datapath.ops import _checks, _inputs
from datapath.ops._graph import CSRView, as_csr
from datapath.ops._torch_backend import AggSpec
from datapath.ops.errors import FeatureShapeError, UnsupportedDtypeError

REDUCTIONS = ("sum", "mean", "max")
NORMS = (None, "gcn")


class _AggregateFn(torch.autograd.Function):
    """out = aggregate(x, weight); backward for x (transposed CSR on GPU) and for the edge weight (SDDMM)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, csr: CSRView, spec: AggSpec,
                backend: Any) -> torch.Tensor:  # type: ignore[override]
        out, argmax = backend.forward(csr, x, weight, spec)
        ctx.csr, ctx.spec, ctx.backend = csr, spec, backend
        # the common gradient (of x alone, sum family, no weight): its kernel resolved now, on the calling thread,
        # so that the backward (on autograd's device thread) only launches it
        ctx.run_t = (_runner(csr, spec, x.shape[1], x.dtype, backend)
                     if weight is None and spec.reduce == "sum" and spec.heads == 1 and spec.src_ids is None
                     and spec.plan is None and ctx.needs_input_grad[0] else None)
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype if weight is not None else None
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight, argmax)
        if argmax is not None:
            ctx.mark_non_differentiable(argmax)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.run_t is not None:
            return ctx.run_t(grad_out.contiguous()), None, None, None, None
        x, weight, argmax = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.backend.backward_x(ctx.csr, grad_out, weight, ctx.spec, argmax, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = ctx.backend.backward_weight(ctx.csr, x, grad_out, ctx.spec, argmax, ctx.w_dtype)
            grad_w = grad_w.view(weight.shape)
        return grad_x, grad_w, None, None, None


def _check_reduce(reduce: str, norm: str | None) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be None or 'gcn', got {norm!r}")
    if norm == "gcn" and reduce != "sum":
        raise ValueError(f"norm='gcn' is a normalized sum; use reduce='sum' (got {reduce!r})")


def _spec(csr: CSRView, reduce: str, norm: str | None, sdt: torch.dtype, heads: int, ids: torch.Tensor | None,
          plan: Any, on_host: bool, grad_x: bool) -> AggSpec:
    row_scale = col_scale = None
    variant = reduce
    if reduce == "mean":
        row_scale = csr.row_scale("mean", sdt)
    elif norm == "gcn":
        variant = "gcn"
        row_scale = csr.row_scale("gcn", sdt)
        col_scale = csr.col_scale_gcn(sdt)
    return AggSpec("max" if reduce == "max" else "sum", row_scale, col_scale, heads, ids, plan, on_host, variant,
                   grad_x)


def _kept_spec(csr: CSRView, reduce: str, norm: str | None, sdt: torch.dtype, grad_x: bool) -> AggSpec:
    key = ("spec", reduce, norm, sdt, grad_x)
    spec = csr.cache.get(key)
    if spec is None:
        spec = csr.cache[key] = _spec(csr, reduce, norm, sdt, 1, None, None, False, grad_x)
    return spec


def aggregate(graph: Any, x: torch.Tensor, reduce: str = "sum", edge_weight: torch.Tensor | None = None,
              norm: str | None = None, src_ids: torch.Tensor | None = None, plan: Any = None) -> torch.Tensor:
    """Aggregate source features into destination rows: ``out[d] = REDUCE_{e in row d} w_e * x[src_e]``.

    Args:
        graph: a CSR of destination rows (the `datapath.graph.CSR` protocol: `Graph`, `Block`,
            `CSRGraph`, or a tuple ``(indptr, indices, num_src_nodes)``), on x's device.  Checked
            once per graph object unless it is ``trusted``; what the kernels derive from it
            (transposed CSR, schedules, the chosen kernel) is kept with it (a weak-keyed cache).
        x: (num_src, F) or (num_src, H, D) float16/bfloat16/float32/float64 source features; with
            ``src_ids``, the feature *table* (rows, F): CUDA, pinned CPU or unified.
        reduce: ``"sum"``, ``"mean"`` (sum / in-degree) or ``"max"``; rows without edges give 0.
        edge_weight: optional (E,) or (E, H) weight per CSR position (H heads of (num_src, H, D) features).
        norm: ``"gcn"`` for the symmetric normalization ``1/sqrt(deg_out(src) * deg_in(dst))`` (edge
            counts, clamped at 1; only with ``reduce="sum"``).
        src_ids: optional (num_src,) int map into the feature table: the op reads ``x[src_ids]`` without
            materializing it (fused gather; from host memory when the table is unified/pinned). The
            table gets no gradient.
        plan: an `AggregationPlan` forcing the CUDA kernel and its launch (`plan_aggregation`); by
            default the graph's own plan (see `datapath.ops.plan`).  Ignored on the CPU.

    Returns:
        (num_dst, F) or (num_dst, H, D), x's dtype, on x's (or src_ids') device; accumulates in float32
        (float64 for float64) -- unless a ``plan`` forces ``kernel="cusparse"`` on float16/bfloat16 rows,
        which cuSPARSE accumulates in their own precision (the graph's own plan never does that on rows
        longer than 16 edges).  Empty inputs (no rows, no columns) give an empty or zero result.
    """
    if reduce not in REDUCTIONS or norm is not None:
        _check_reduce(reduce, norm)
    _inputs.check_float(x, "x")
    csr = as_csr(graph)
    on_host = False
    if src_ids is not None:
        if x.requires_grad and torch.is_grad_enabled():
            raise FeatureShapeError(
                "aggregate with src_ids reads the feature table in place and gives it no gradient, but the "
                "table requires grad; gather first (x[src_ids]) or detach the table"
            )
        on_host = src_ids.device.type == "cuda" and x.device.type != "cuda"
        table = _inputs.resolve_table(x, src_ids)
        ids = _inputs.check_ids(src_ids, table.shape[0], csr.num_src, "src_ids")
        device = ids.device
        xf, tail = _inputs.flat_features(table, "the feature table")
    else:
        ids = None
        device = x.device
        if x.shape[0] != csr.num_src:
            raise FeatureShapeError(
                f"x has {x.shape[0]} rows but the graph has {csr.num_src} source nodes; pass x of shape "
                f"(num_src_nodes, F) (for a block: the features of its source nodes)"
            )
        xf, tail = _inputs.flat_features(x, "x")
    if csr.device != device:
        _inputs.check_graph_device(csr, device)
    heads = 1
    w = None
    if edge_weight is not None:
        heads = _inputs.edge_weight_heads(edge_weight, csr.num_edges, tail, device)
        w = edge_weight.reshape(csr.num_edges, heads)
        if not w.is_contiguous():
            w = w.contiguous()
    feat = xf.shape[1]
    if feat == 0 or csr.num_dst == 0:
        out = torch.zeros(csr.num_dst, *tail, dtype=x.dtype, device=device)
        if torch.is_grad_enabled():  # an empty result still belongs to every input's graph (zero gradients)
            if xf.requires_grad:
                out = out + 0 * xf.sum()
            if w is not None and w.requires_grad:
                out = out + 0 * w.sum().to(out.dtype)
        return out
    grad = torch.is_grad_enabled() and (xf.requires_grad or (w is not None and w.requires_grad))
    grad_x = grad and xf.requires_grad
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if ids is None and plan is None and heads == 1:  # the common call: its spec is kept with the graph
        spec = _kept_spec(csr, reduce, norm, sdt, grad_x)
    else:
        spec = _spec(csr, reduce, norm, sdt, heads, ids, plan, on_host, grad_x)
    backend = _inputs.backend_for(device)
    if grad:
        out = _AggregateFn.apply(xf, w, csr, spec, backend)
    else:
        out = backend.forward(csr, xf, w, spec)[0]
    return out if len(tail) == 1 else out.view(csr.num_dst, *tail)


def aggregate_transposed(graph: Any, y: torch.Tensor, reduce: str = "sum", norm: str | None = None) -> torch.Tensor:
    """The transposed aggregation: what `aggregate` sends back from the destination rows to the sources.

    ``out[s] = sum over the edges s -> d of c(d, s) * y[d]``, with ``c`` the coefficient the same
    ``aggregate(graph, x, reduce, norm=norm)`` gives edge ``s -> d`` (1, 1/in-degree for ``"mean"``,
    GCN's symmetric norm): for an output gradient ``y`` it is the gradient of that call with
    respect to ``x``.  It runs over the transposed CSR kept with the graph (built once, no host
    synchronisation), by the kernel planned for it (on an untrusted whole graph, probed once).
    For writing one autograd node for a whole layer (see `datapath.nn`) instead of a node per op.

    Args:
        graph: as for `aggregate`.
        y: (num_dst, F) float16/bfloat16/float32/float64 on the graph's device; not tracked by autograd
            (call it in a custom backward or under ``torch.no_grad()``).
        reduce: ``"sum"`` or ``"mean"``.
        norm: None or ``"gcn"`` (with ``reduce="sum"``).

    Returns:
        (num_src, F) in y's dtype on y's device.
    """
    if reduce not in ("sum", "mean") or norm is not None:
        _check_reduce(reduce, norm)
        if reduce == "max":
            raise ValueError("aggregate_transposed takes reduce='sum' or 'mean' (a max has no fixed transpose)")
    _inputs.check_float(y, "y")
    csr = as_csr(graph)
    if y.dim() != 2 or y.shape[0] != csr.num_dst:
        raise FeatureShapeError(
            f"y must be (num_dst_nodes, F) = ({csr.num_dst}, F), one row per destination; got {tuple(y.shape)}"
        )
    if csr.device != y.device:
        _inputs.check_graph_device(csr, y.device)
    if y.requires_grad and torch.is_grad_enabled():
        raise FeatureShapeError(
            "aggregate_transposed is not tracked by autograd but y requires grad; call it under torch.no_grad() or "
            "inside a custom backward (its gradient is aggregate(graph, ., reduce, norm=norm))"
        )
    feat = y.shape[1]
    if feat == 0 or csr.num_edges == 0:
        return torch.zeros(csr.num_src, feat, dtype=y.dtype, device=y.device)
    run = _transposed(csr, feat, y.dtype, reduce, norm)
    return run(y if y.is_contiguous() else y.contiguous())


def _runner(csr: CSRView, spec: AggSpec, feat: int, dtype: torch.dtype, backend: Any) -> Any:
    make = getattr(backend, "transposed_runner", None)
    if make is not None:  # its launches check the rows they are given
        return make(csr, spec, feat, dtype)
    shape = torch.Size((csr.num_dst, feat))

    def run(g: torch.Tensor) -> torch.Tensor:
        if g.shape != shape or g.dtype != dtype:
            raise _checks.rows_error(g, tuple(shape), dtype, "the transposed aggregation's rows")
        return backend.backward_x(csr, g, None, spec, None, dtype)
    return run


def _transposed(csr: CSRView, feat: int, dtype: torch.dtype, reduce: str, norm: str | None) -> Any:
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    return _runner(csr, _kept_spec(csr, reduce, norm, sdt, True), feat, dtype, _inputs.backend_for(csr.device))


def transposed_aggregator(graph: Any, feat: int, dtype: torch.dtype, reduce: str = "sum",
                          norm: str | None = None) -> Any:
    """`aggregate_transposed` for rows of width ``feat`` and ``dtype``, resolved once: ``run(y)`` launches its kernel.

    Checks the graph, picks (on an untrusted whole graph: probes) the transposed CSR's kernel and
    returns a callable taking a contiguous (num_dst, feat) ``dtype`` tensor ``y`` on the graph's
    device and returning (num_src, feat) ``A^T y``, with no further checks: for a custom autograd
    node that resolves it in its forward and only launches in its backward (which runs on
    autograd's device thread, where host work costs most).  Not tracked by autograd.
    """
    if reduce not in ("sum", "mean") or norm is not None:
        _check_reduce(reduce, norm)
        if reduce == "max":
            raise ValueError("transposed_aggregator takes reduce='sum' or 'mean' (a max has no fixed transpose)")
    if feat < 1:
        raise ValueError(f"feat must be >= 1, got {feat}")
    if dtype not in _inputs.FLOAT_DTYPES:
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; use float16, bfloat16, float32 or float64")
    csr = as_csr(graph)
    if csr.num_edges == 0:
        return lambda y: torch.zeros(csr.num_src, feat, dtype=y.dtype, device=y.device)
    return _transposed(csr, feat, dtype, reduce, norm)


def prepare_aggregation(graph: Any, feat: int, dtype: torch.dtype = torch.float32, *, backward: bool = True,
                        plan: Any = None, reduce: str = "sum", norm: str | None = None) -> list[torch.Tensor]:
    """Precompute, on the current stream, what a sum/mean `aggregate` over ``graph`` will need.

    The CUDA kernels read per-graph data: the scale vectors of ``mean``/``gcn``, the kernel's
    schedule and, for the gradient, the transposed CSR and its schedule (a sort and a few small
    ops per graph, none of which waits for the GPU on a sampled block).  Built here, e.g. in a
    data loader's thread while the previous batch trains (`NeighborLoader`'s ``prepare``), the
    training step launches only its own kernels.  Kept with the graph (weak-keyed); later
    `aggregate` calls with the same width and dtype find them.

    Args:
        graph: as for `aggregate`.
        feat: width F of the rows that will be aggregated (after any projection).
        dtype: their dtype.
        backward: also what the gradient with respect to the rows needs.
        plan: the `AggregationPlan` the calls will pass, if any.
        reduce: as the calls will pass it (``"max"`` needs nothing prepared).
        norm: as the calls will pass it.

    Returns:
        Every tensor kept with the graph (call ``record_stream`` on them before using the graph
        on another stream); empty where nothing needs preparing (the CPU, ``reduce="max"``).
    """
    if feat < 1:
        raise ValueError(f"feat must be >= 1, got {feat}")
    _check_reduce(reduce, norm)
    csr = as_csr(graph)
    if reduce == "max" or csr.num_dst == 0:
        return []
    backend = _inputs.backend_for(csr.device)
    prep = getattr(backend, "prepare", None)
    if prep is None:
        return []
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    for grad_x in (False, True):
        spec = _kept_spec(csr, reduce, norm, sdt, grad_x)  # builds the scale vectors
    return prep(csr, int(feat), dtype, backward, plan, spec)
