"""Plain-PyTorch implementation of the aggregation ops (the CPU path; also runs on CUDA tensors).

Every function computes in float32 (float64 for float64 inputs) and returns the input dtype.
The CUDA kernels in `datapath.ops._cuda_backend` implement the same contract.

The aggregation computed (``s = indices[e]``, ``d`` its destination row, ``h(f)`` the head
of feature column ``f`` when the edge weight has ``H`` heads)::

    out[d, f] = row_scale[d] * REDUCE_e  weight[e, h(f)] * col_scale[s] * x[src_ids[s] or s, f]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from datapath.ops._graph import CSRView


@dataclass(frozen=True, eq=False)
class AggSpec:
    """What to aggregate: the reduction and the optional scale vectors, heads and source map."""

    reduce: str                             # "sum" or "max" (mean and gcn are sums with scales)
    row_scale: torch.Tensor | None          # (num_dst,) float32
    col_scale: torch.Tensor | None          # (num_src,) float32
    heads: int                              # columns of the edge weight (1 for (E,) weights)
    src_ids: torch.Tensor | None            # (num_src,) int64 rows of the feature table, or None
    plan: Any = None                        # the CUDA launch plan (AggregationPlan); unused here
    table_on_host: bool = False             # src_ids index a pinned host table (read over PCIe)
    variant: str = "sum"                    # "sum", "mean" or "gcn": which scales (the plans' key)
    grad_x: bool = False                    # the features will need a gradient


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for features of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _edge_coef(csr: CSRView, weight: torch.Tensor | None, spec: AggSpec, acc: torch.dtype) -> torch.Tensor | None:
    """(E, H) per-edge multiplier (weight times source scale), or None when it is all ones."""
    coef = None
    if weight is not None:
        coef = weight.reshape(csr.num_edges, spec.heads).to(acc)
    if spec.col_scale is not None:
        cs = spec.col_scale.to(acc).index_select(0, csr.indices64()).unsqueeze(1)
        coef = cs if coef is None else coef * cs
    return coef


def _messages(csr: CSRView, x: torch.Tensor, coef: torch.Tensor | None, spec: AggSpec,
              acc: torch.dtype) -> torch.Tensor:
    ids = csr.indices64()
    if spec.src_ids is not None:
        ids = spec.src_ids.index_select(0, ids)
    rows = x.index_select(0, ids).to(acc)
    if coef is None:
        return rows
    e, f = rows.shape
    return (rows.view(e, spec.heads, f // spec.heads) * coef.unsqueeze(2)).view(e, f)


def forward(csr: CSRView, x: torch.Tensor, weight: torch.Tensor | None,
            spec: AggSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (num_dst, F) x.dtype, argmax (num_dst, F) int64 edge positions or None)``; x is (rows, F)."""
    acc = acc_dtype(x.dtype)
    f = x.shape[1]
    msg = _messages(csr, x, _edge_coef(csr, weight, spec, acc), spec, acc)
    dst = csr.edge_dst()
    argmax = None
    if spec.reduce == "sum":
        out = torch.zeros(csr.num_dst, f, dtype=acc, device=x.device).index_add_(0, dst, msg)
    else:
        idx2 = dst.unsqueeze(1).expand(-1, f)
        out = torch.full((csr.num_dst, f), float("-inf"), dtype=acc, device=x.device)
        out.scatter_reduce_(0, idx2, msg, "amax", include_self=True)
        pos = torch.arange(csr.num_edges, device=x.device).unsqueeze(1).expand(-1, f)
        cand = torch.where(msg == out.index_select(0, dst), pos, csr.num_edges)
        argmax = torch.full((csr.num_dst, f), csr.num_edges, dtype=torch.int64, device=x.device)
        argmax.scatter_reduce_(0, idx2, cand, "amin", include_self=True)
        empty = argmax == csr.num_edges
        out = out.masked_fill(empty, 0.0)
        argmax = argmax.masked_fill(empty, -1)
    if spec.row_scale is not None:
        out = out * spec.row_scale.to(acc).unsqueeze(1)
    return out.to(x.dtype), argmax


def _scaled_grad(grad_out: torch.Tensor, spec: AggSpec) -> torch.Tensor:
    g = grad_out.to(acc_dtype(grad_out.dtype))
    if spec.row_scale is not None:
        g = g * spec.row_scale.to(g.dtype).unsqueeze(1)
    return g


def backward_x(csr: CSRView, grad_out: torch.Tensor, weight: torch.Tensor | None, spec: AggSpec,
               argmax: torch.Tensor | None, x_dtype: torch.dtype) -> torch.Tensor:
    """(num_src, F) gradient of the features (``spec.src_ids`` must be None)."""
    g = _scaled_grad(grad_out, spec)
    acc = g.dtype
    f = g.shape[1]
    coef = _edge_coef(csr, weight, spec, acc)
    grad_x = torch.zeros(csr.num_src, f, dtype=acc, device=g.device)
    if spec.reduce == "sum":
        m = g.index_select(0, csr.edge_dst())
        if coef is not None:
            m = (m.view(-1, spec.heads, f // spec.heads) * coef.unsqueeze(2)).view(-1, f)
        grad_x.index_add_(0, csr.indices64(), m)
        return grad_x.to(x_dtype)
    assert argmax is not None
    if csr.num_edges == 0:
        return grad_x.to(x_dtype)
    # every (row, column) adds its gradient to its maximal edge's source; rows without edges
    # (argmax -1) add zero to position 0 (no boolean masks: they would wait for the GPU)
    valid = argmax >= 0
    e = argmax.clamp(min=0)
    gv = torch.where(valid, g, 0)
    if coef is not None:
        head = (torch.arange(f, device=g.device) // (f // spec.heads)).unsqueeze(0).expand_as(argmax)
        gv = gv * coef[e, head]
    col = torch.arange(f, device=g.device).unsqueeze(0).expand_as(argmax)
    grad_x.view(-1).index_add_(0, (csr.indices64()[e] * f + col).reshape(-1), gv.reshape(-1))
    return grad_x.to(x_dtype)


def backward_weight(csr: CSRView, x: torch.Tensor, grad_out: torch.Tensor, spec: AggSpec,
                    argmax: torch.Tensor | None, w_dtype: torch.dtype) -> torch.Tensor:
    """(E, H) gradient of the edge weight."""
    g = _scaled_grad(grad_out, spec)
    acc = g.dtype
    f = g.shape[1]
    d = f // spec.heads
    rows = _messages(csr, x, _edge_coef(csr, None, spec, acc), spec, acc)  # col_scale * x[src]
    if spec.reduce == "sum":
        prod = rows * g.index_select(0, csr.edge_dst())
        return prod.view(-1, spec.heads, d).sum(2).to(w_dtype)
    assert argmax is not None
    valid = argmax >= 0
    e = argmax.clamp(min=0)
    col = torch.arange(f, device=g.device).unsqueeze(0).expand_as(argmax)
    contrib = torch.where(valid, g * rows[e, col], 0) if csr.num_edges else g * 0
    grad_w = torch.zeros(max(1, csr.num_edges) * spec.heads, dtype=acc, device=g.device)
    grad_w.index_add_(0, (e * spec.heads + col // d).reshape(-1), contrib.reshape(-1))
    return grad_w[: csr.num_edges * spec.heads].view(-1, spec.heads).to(w_dtype)


def sddmm_dot(csr: CSRView, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(E, H) per-edge, per-head dot products of ``a[dst]`` (num_dst, H, D) and ``b[src]`` (num_src, H, D)."""
    acc = acc_dtype(a.dtype)
    prod = a.index_select(0, csr.edge_dst()).to(acc) * b.index_select(0, csr.indices64()).to(acc)
    return prod.sum(2).to(a.dtype)


def edge_softmax(csr: CSRView, scores: torch.Tensor) -> torch.Tensor:
    """(E, H) softmax of ``scores`` (E, H) over the edges of each destination row."""
    acc = acc_dtype(scores.dtype)
    s = scores.to(acc)
    dst = csr.edge_dst()
    h = s.shape[1]
    idx2 = dst.unsqueeze(1).expand(-1, h)
    mx = torch.full((csr.num_dst, h), float("-inf"), dtype=acc, device=s.device)
    mx.scatter_reduce_(0, idx2, s, "amax", include_self=True)
    ex = torch.exp(s - mx.index_select(0, dst))
    den = torch.zeros(csr.num_dst, h, dtype=acc, device=s.device).index_add_(0, dst, ex)
    return (ex / den.index_select(0, dst)).to(scores.dtype)


def edge_softmax_backward(csr: CSRView, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(E, H) gradient of the scores given the softmax output ``p`` and its gradient."""
    acc = acc_dtype(p.dtype)
    pg = p.to(acc) * grad.to(acc)
    dst = csr.edge_dst()
    rs = torch.zeros(csr.num_dst, p.shape[1], dtype=acc, device=p.device).index_add_(0, dst, pg)
    return (pg - p.to(acc) * rs.index_select(0, dst)).to(p.dtype)
