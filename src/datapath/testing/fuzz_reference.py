"""Float64 CPU references of every op and layer the fuzz checks, written from the definitions (edge lists and
``index_add``), sharing no code with `datapath.ops`: what the kernels and the CPU backend are compared against.

Every function takes CPU float64 tensors (autograd-capable) and the graph's edge lists ``src``/``dst``
(int64, CSR order: `datapath.testing.fuzz_graphs.edge_lists`), and returns CPU float64.

The sums over edges -- forward rows and, through autograd, the gradients' columns -- are accurately rounded
(`scatter_sum`): a float64 ``index_add`` sums sequentially and, on a long run of equal terms (a hub row's
duplicate edges, a hub's gradient ``gy/deg`` repeated down a source's column), its rounding errors add up
linearly, up to ``(L-1) u`` (Higham's bound): as large as the kernel's own error in a float64 case.  The
reference then measures the kernel alone.  A max sends its gradient to one edge (`gather` of the arg max),
not split over tied copies of one source and summed back.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

F64 = torch.float64


def _sum_exact(index: torch.Tensor, terms: torch.Tensor, n: int) -> torch.Tensor:
    """``out[i] = sum_{e: index_e = i} terms[e]`` in float64, accurately rounded (~1 u, any row length).

    Each term splits exactly into ``hi + lo``: ``hi`` on a grid ``g_i`` (a power of two) so coarse that every
    partial sum of a row's ``hi`` is an integer multiple of ``g_i`` below ``2**52 g_i`` -- exact in float64 --
    and ``|lo| <= g_i / 2``, whose float64 sum is off by at most ``L**2 u g_i``, ``~2**-51 L**2 u`` of the row's
    ``sum |terms|``.  Two ``index_add`` passes and one final rounding."""
    out_shape = (n, *terms.shape[1:])
    mag = torch.zeros(out_shape, dtype=F64).index_add(0, index, terms.abs())
    _, exp = torch.frexp(mag)  # mag < 2**exp (up to mag's own rounding, covered by the spare bit)
    grid = torch.ldexp(torch.ones_like(mag), (exp - 51).clamp(min=-1074)).index_select(0, index)
    hi = torch.round(terms / grid) * grid  # powers of two: exact scaling
    lo = terms - hi  # exact: |lo| <= grid / 2 and lo a multiple of the term's last bit
    out = torch.zeros(out_shape, dtype=F64).index_add(0, index, hi) + \
        torch.zeros(out_shape, dtype=F64).index_add(0, index, lo)
    bad = ~torch.isfinite(mag)  # an infinite or NaN term: the plain sum carries it
    if bool(bad.any()):
        out = torch.where(bad, torch.zeros(out_shape, dtype=F64).index_add(0, index, terms), out)
    return out


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, index: torch.Tensor, terms: torch.Tensor, n: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(index)
        return _sum_exact(index, terms.detach(), n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:  # noqa: D102
        (index,) = ctx.saved_tensors
        return None, grad.index_select(0, index), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        return x.detach().index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        (index,) = ctx.saved_tensors
        return scatter_sum(index, grad, ctx.n), None


def scatter_sum(index: torch.Tensor, terms: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.zeros(n, ...).index_add(0, index, terms)`` accurately rounded, forward and backward (float64)."""
    return _ScatterSum.apply(index, terms, n)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` whose gradient sums each row's copies accurately (`scatter_sum`)."""
    return _Gather.apply(x, index)


def _per_edge(weight: torch.Tensor, msg: torch.Tensor) -> torch.Tensor:
    """(E,) or (E, H) weights shaped to multiply (E, F) or (E, H, D) messages."""
    return weight.reshape(weight.shape[0], *weight.shape[1:], *([1] * (msg.dim() - weight.dim())))


def aggregate(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x: torch.Tensor, reduce: str = "sum",
              weight: torch.Tensor | None = None, norm: str | None = None, num_src: int | None = None
              ) -> torch.Tensor:
    """``out[d] = REDUCE_{e: dst_e = d} w_e c_e x[src_e]`` (rows without edges: 0); x (num_src, F) or (num_src, H, D),
    weight (E,) or (E, H); ``norm="gcn"``: ``c_e = 1/sqrt(max(deg_out(src_e),1) max(deg_in(d),1))``."""
    num_src = x.shape[0] if num_src is None else num_src
    msg = gather(x, src)
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
        best = out.scatter_reduce(0, idx, msg.detach(), "amax", include_self=False)
        # the first edge reaching each row's max takes the whole gradient (ties of distinct values: left out by
        # the callers, `max_ties`); rows without edges stay 0
        edge = torch.arange(src.numel()).reshape(-1, *([1] * (msg.dim() - 1))).expand_as(msg)
        hit = torch.where(msg.detach() == best.index_select(0, dst), edge, src.numel())
        first = torch.full(out_shape, src.numel(), dtype=torch.int64).scatter_reduce(0, idx, hit, "amin")
        has = first < src.numel()
        picked = msg.reshape(src.numel(), -1).gather(0, first.clamp(max=max(0, src.numel() - 1)).reshape(num_dst, -1))
        return torch.where(has, picked.reshape(out_shape), out)
    out = scatter_sum(dst, msg, num_dst)
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
    den = scatter_sum(dst, e, num_dst)
    p = e / gather(den, dst)
    return p if scores.dim() == 2 else p.squeeze(1)


def sddmm(src: torch.Tensor, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """Per edge: ``<a[dst], b[src]>`` over the last axis (``"dot"``), ``a[dst] + b[src]`` or ``a[dst] * b[src]``."""
    ea, eb = gather(a, dst), gather(b, src)
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
    scores = F.leaky_relu(gather(a_dst, dst) + gather(a_src, src), conv.negative_slope)
    alpha = edge_softmax(dst, num_dst, scores)
    out = aggregate(src, dst, num_dst, hs, "sum", alpha)
    out = out.reshape(-1, h_ * c) if conv.concat else out.mean(1)
    return out + conv.bias if conv.bias is not None else out


def gat_kinks(src: torch.Tensor, dst: torch.Tensor, num_dst: int, x_src: torch.Tensor, x_dst: torch.Tensor,
              conv: Any, paired: bool, u: float) -> torch.Tensor:
    """(num_dst,) bool: destinations with an edge whose attention score lies within ``4 u`` of its terms'
    magnitude (``sum |h att|`` over both ends) of leaky_relu's kink at 0.  A kernel computing the scores in a
    dtype of unit roundoff ``u`` may land on either side (slope 1 or ``negative_slope``): the gradient jumps there,
    so such rows are left out of gradient comparisons, like a max's ties.  Measured: 16-bit scores are off by at
    most 0.77 u of that magnitude (GATConv 300 -> 3 x 38)."""
    if src.numel() == 0:
        return torch.zeros(num_dst, dtype=torch.bool)
    with torch.no_grad():
        h_, c = conv.heads, conv.out_channels
        lin_s, lin_d = (conv.lin, conv.lin) if conv.lin is not None else (conv.lin_src, conv.lin_dst)
        hs = F.linear(x_src.detach(), lin_s.weight).view(-1, h_, c) * conv.att_src
        hd = (F.linear(x_dst.detach(), lin_d.weight).view(-1, h_, c) if paired or conv.lin is None
              else (F.linear(x_src.detach(), lin_s.weight).view(-1, h_, c)[:num_dst])) * conv.att_dst
        score = hd.sum(-1).index_select(0, dst) + hs.sum(-1).index_select(0, src)
        mag = hd.abs().sum(-1).index_select(0, dst) + hs.abs().sum(-1).index_select(0, src)
        near = (score.abs() <= 4 * u * mag).any(1)
        return torch.zeros(num_dst, dtype=torch.bool).index_fill(0, dst[near], True)


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
