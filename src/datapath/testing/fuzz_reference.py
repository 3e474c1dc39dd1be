"""Float64 CPU references of every op and layer the fuzz checks, written from the definitions (edge lists and
``index_add``), sharing no code with `datapath.ops`: what the kernels and the CPU backend are compared against.

Every function takes CPU float64 tensors (autograd-capable) and the graph's edge lists ``src``/``dst``
(int64, CSR order: `datapath.testing.fuzz_graphs.edge_lists`), and returns CPU float64.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

F64 = torch.float64


def _per_edge(weight: torch.Tensor, msg: torch.Tensor) -> torch.Tensor:
    """(E,) or (E, H) weights shaped to multiply (E, F) or (E, H, D) messages."""
    return weight.reshape(weight.shape[0], *weight.shape[1:], *([1] * (msg.dim() - weight.dim())))


def aggregate(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x: torch.Tensor, reduce: str = "sum",
              weight: torch.Tensor | None = None, norm: str | None = None, num_src: int | None = None
              ) -> torch.Tensor:
    """``out[d] = REDUCE_{e: dst_e = d} w_e c_e x[src_e]`` (rows without edges: 0); x (num_src, F) or (num_src, H, D),
    weight (E,) or (E, H); ``norm="gcn"``: ``c_e = 1/sqrt(max(deg_out(src_e),1) max(deg_in(d),1))``."""
    num_src = x.shape[0] if num_src is None else num_src
    msg = x.index_select(0, src)
    if weight is not None:
        msg = msg * _per_edge(weight, msg)
    deg_in = torch.bincount(dst, minlength=num_dst).clamp(min=1).to(F64)
    if norm == "gcn":
        deg_out = torch.bincount(src, minlength=num_src).clamp(min=1).to(F64)
        c = (deg_out.index_select(0, src) * deg_in.index_select(0, dst)).rsqrt()
        msg = msg * c.reshape(-1, *([1] * (msg.dim() - 1)))
    out_shape = (num_dst, *x.shape[1:])
    if reduce == "max":
        out = torch.zeros(out_shape, dtype=F64)
        if src.numel() == 0:
            return out + 0 * x.sum()
        idx = dst.reshape(-1, *([1] * (msg.dim() - 1))).expand_as(msg)
        out = out.scatter_reduce(0, idx, msg, "amax", include_self=False)
        return out
    out = torch.zeros(out_shape, dtype=F64).index_add(0, dst, msg)
    if reduce == "mean":
        out = out / deg_in.reshape(-1, *([1] * (out.dim() - 1)))
    return out


def max_ties(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x: torch.Tensor,
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """(num_dst, F) bool: where a row's max is reached by two edges of different values' sources (a max
    gradient may go to either: such positions are left out of the gradient comparison)."""
    with torch.no_grad():
        msg = x.index_select(0, src)
        if weight is not None:
            msg = msg * _per_edge(weight, msg)
        best = aggregate(src, dst, num_dst, x.detach(), "max", None if weight is None else weight.detach())
        hit = (msg == best.index_select(0, dst)).to(torch.int64)
        # two hits of one source in a row are no tie (the gradient lands on the same row of x) unless weighted
        if weight is None:
            key = dst * (int(src.max()) + 1 if src.numel() else 1) + src
            _, first = torch.unique(key, return_inverse=True)
            seen = torch.zeros(int(first.max()) + 1 if first.numel() else 0, *hit.shape[1:], dtype=torch.int64)
            seen = seen.index_add(0, first, hit).clamp(max=1)
            uniq_dst = torch.zeros(seen.shape[0], dtype=torch.int64).index_copy(0, first, dst)
            count = torch.zeros(num_dst, *hit.shape[1:], dtype=torch.int64).index_add(0, uniq_dst, seen)
        else:
            count = torch.zeros(num_dst, *hit.shape[1:], dtype=torch.int64).index_add(0, dst, hit)
        return count > 1


def edge_softmax(dst: torch.Tensor, num_dst: int, scores: torch.Tensor) -> torch.Tensor:
    """Softmax of (E,) or (E, H) scores over each destination's incoming edges."""
    s = scores if scores.dim() == 2 else scores.unsqueeze(1)
    idx = dst.unsqueeze(1).expand_as(s)
    top = torch.full((num_dst, s.shape[1]), -torch.inf, dtype=F64).scatter_reduce(0, idx, s.detach(), "amax")
    e = (s - top.index_select(0, dst)).exp()
    den = torch.zeros(num_dst, s.shape[1], dtype=F64).index_add(0, dst, e)
    p = e / den.index_select(0, dst)
    return p if scores.dim() == 2 else p.squeeze(1)


def sddmm(src: torch.Tensor, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """Per edge: ``<a[dst], b[src]>`` over the last axis (``"dot"``), ``a[dst] + b[src]`` or ``a[dst] * b[src]``."""
    ea, eb = a.index_select(0, dst), b.index_select(0, src)
    if op == "dot":
        return (ea * eb).sum(-1)
    return ea + eb if op == "add" else ea * eb


def _lin(x: torch.Tensor, lin: Any) -> torch.Tensor:
    return F.linear(x, lin.weight, lin.bias)


def sage(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x_src: torch.Tensor, x_dst: torch.Tensor, conv: Any,
         weight: torch.Tensor | None = None) -> torch.Tensor:
    """SAGEConv: ``lin_l(AGG x_src) + lin_r(x_dst)`` (normalized); ``conv`` the float64 CPU copy of the layer."""
    h = _lin(aggregate(src, dst, num_dst, x_src, conv.aggr, weight), conv.lin_l)
    if conv.lin_r is not None:
        h = h + F.linear(x_dst, conv.lin_r.weight)
    return F.normalize(h, p=2.0, dim=-1) if conv.normalize else h


def _loops(src: torch.Tensor, dst: torch.Tensor, num_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    loop = torch.arange(num_dst)
    return torch.cat([src, loop]), torch.cat([dst, loop])


def gcn(src: torch.Tensor, dst: torch.Tensor, num_dst: int, num_src: int, x_src: torch.Tensor, conv: Any,
        weight: torch.Tensor | None = None) -> torch.Tensor:
    """GCNConv: ``sum_e w_e c_e (x W^T)[src_e] + b`` with GCN's symmetric norm (edge counts) if ``normalize``."""
    if conv.add_self_loops:
        src, dst = _loops(src, dst, num_dst)
    h = aggregate(src, dst, num_dst, F.linear(x_src, conv.lin.weight), "sum", weight,
                  "gcn" if conv.normalize else None, num_src=num_src)
    return h + conv.bias if conv.bias is not None else h


def gin(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x_src: torch.Tensor, x_dst: torch.Tensor, conv: Any,
        weight: torch.Tensor | None = None) -> torch.Tensor:
    """GINConv: ``nn((1 + eps) x_dst + AGG x_src)``."""
    h = aggregate(src, dst, num_dst, x_src, conv.aggr, weight)
    return conv.nn(h + (1 + conv.eps) * x_dst)


def gat(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x_src: torch.Tensor, x_dst: torch.Tensor, conv: Any,
        paired: bool) -> torch.Tensor:
    """GATConv (no dropout): attention over each destination's incoming edges, heads concatenated or averaged."""
    h_, c = conv.heads, conv.out_channels
    if conv.lin is not None:
        hs = F.linear(x_src, conv.lin.weight).view(-1, h_, c)
        hd = F.linear(x_dst, conv.lin.weight).view(-1, h_, c) if paired else hs[:num_dst]
    else:
        hs = F.linear(x_src, conv.lin_src.weight).view(-1, h_, c)
        hd = F.linear(x_dst, conv.lin_dst.weight).view(-1, h_, c)
    a_src = (hs * conv.att_src).sum(-1)
    a_dst = (hd * conv.att_dst).sum(-1)
    scores = F.leaky_relu(a_dst.index_select(0, dst) + a_src.index_select(0, src), conv.negative_slope)
    alpha = edge_softmax(dst, num_dst, scores)
    out = aggregate(src, dst, num_dst, hs, "sum", alpha)
    out = out.reshape(-1, h_ * c) if conv.concat else out.mean(1)
    return out + conv.bias if conv.bias is not None else out


def full_graph(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, x: torch.Tensor, model: Any) -> torch.Tensor:
    """A `datapath.nn.GCN` / `GIN` full-graph model in eval mode (ReLU between layers, no dropout)."""
    h = x
    for i, conv in enumerate(model.convs):
        if type(conv).__name__ == "GCNConv":
            h = gcn(src, dst, num_nodes, num_nodes, h, conv)
        else:
            h = gin(src, dst, num_nodes, h, h, conv)
        if i < len(model.convs) - 1:
            h = F.relu(h)
    return h
