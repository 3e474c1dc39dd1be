"""One autograd node for a conv layer that projects its rows and then aggregates them.

GCN, GIN (one ``Linear``) and GraphSAGE (sum/mean, narrowing) compute::

    h = x W^T;   out = AGG(h) + root + b,   root = c * h[:num_dst]    (GIN: shares W; c = 1 + eps)
                                                 = x_dst R^T          (SAGE: its own weight)

Built from separate ops, that is four or five autograd nodes and a kernel per op each way.  On
a small graph a training step costs its host work, and the backward runs on autograd's device
thread, where every node, and a Python node most, costs more than in the forward.  Here the
layer is one node; its backward is::

    gb = sum_rows(g);  gh = AGG^T(g) (+ c * g into its first num_dst rows when W is shared)
    gW = gh^T x;  gx = gh W;  own root: gR = g^T x_dst, gx[:num_dst] += g R (or g_x_dst = g R)

`datapath.ops.transposed_aggregator` gives ``AGG^T`` (the transposed CSR kept with the graph).  The
layers use it for whole graphs and blocks without edge weights and outside autocast; everything
else takes the op-by-op path.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from datapath.ops import CSRView, aggregate, transposed_aggregator

ROOTS = ("none", "shared", "own")


def _forward(x: torch.Tensor, x_dst: torch.Tensor | None, weight: torch.Tensor, root_weight: torch.Tensor | None,
             bias: torch.Tensor | None, scale: torch.Tensor | None, csr: CSRView, reduce: str, norm: str | None,
             root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(out, h, r)``: the layer's output, ``h = x W^T`` and the root term before its scale (None: not kept)."""
    nd = csr.num_dst
    h = torch.mm(x, weight.t())
    out = aggregate(csr, h, reduce, norm=norm)
    r = None
    if root == "shared":
        r = h if h.shape[0] == nd else h[:nd]
    elif root == "own":
        xd = x[:nd] if x_dst is None else x_dst
        r = torch.mm(xd, root_weight.t()) if scale is not None else None
        if r is None:
            out.addmm_(xd, root_weight.t())
    if r is not None and scale is not None:
        out.addcmul_(r, scale)
    elif r is not None:
        out.add_(r)
    if bias is not None:
        out.add_(bias)
    return out, h, r


class _ProjectAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_dst: torch.Tensor | None, weight: torch.Tensor,  # type: ignore[override]
                root_weight: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
                csr: CSRView, reduce: str, norm: str | None, root: str) -> torch.Tensor:
        out, h, r = _forward(x, x_dst, weight, root_weight, bias, scale, csr, reduce, norm, root)
        ctx.nd, ctx.root = csr.num_dst, root
        need = ctx.needs_input_grad  # the backward's aggregation resolved here, so that it only launches there
        ctx.run_t = transposed_aggregator(csr, h.shape[1], h.dtype, reduce, norm) if need[0] or need[2] else None
        ctx.r = r if scale is not None and ctx.needs_input_grad[5] else None
        ctx.save_for_backward(x, x_dst, weight, root_weight, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, x_dst, weight, root_weight, scale = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = g.contiguous()
        nd = ctx.nd
        gx = gxd = gw = grw = gb = gs = None
        if need[4]:
            gb = g.sum(0)
        if need[5]:
            gs = (g * ctx.r).sum().reshape(scale.shape)
        if need[0] or need[2]:
            gh = ctx.run_t(g)
            if ctx.root == "shared":  # the root term's gradient joins h's
                head = gh if gh.shape[0] == nd else gh[:nd]
                if scale is None:
                    head.add_(g)
                else:
                    head.addcmul_(g, scale)
            if need[2]:
                gw = torch.mm(gh.t(), x)
            if need[0]:
                gx = torch.mm(gh, weight)
        if ctx.root == "own":
            gr = g if scale is None else g * scale  # the root term's gradient
            xd = x[:nd] if x_dst is None else x_dst
            if need[3]:
                grw = torch.mm(gr.t(), xd)
            if x_dst is None:
                if gx is not None:
                    (gx if gx.shape[0] == nd else gx[:nd]).addmm_(gr, root_weight)
            elif need[1]:
                gxd = torch.mm(gr, root_weight)
        return gx, gxd, gw, grw, gb, gs, None, None, None, None


def project_aggregate(csr: CSRView, x: torch.Tensor, weight: torch.Tensor, *, reduce: str = "sum",
                      norm: str | None = None, bias: torch.Tensor | None = None, root: str = "none",
                      x_dst: torch.Tensor | None = None, root_weight: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """``AGG(x W^T) + root + b`` as one autograd node (see the module docstring); with grad mode off (inference)
    the same computation, without a node or anything resolved for a backward.

    Args:
        csr: the graph's validated view; x: (num_src, in); weight: (out, in).
        reduce, norm: as for `datapath.ops.aggregate` (sum or mean).
        bias: (out,) or None.
        root: ``"none"``; ``"shared"`` (``scale * h[:num_dst]``, x_dst the first rows of x); ``"own"``
            (``scale * x_dst root_weight^T``, x_dst None meaning x[:num_dst]).
        scale: None (1) or a (1,)-shaped tensor multiplying the root term (may require grad).
    Returns:
        (num_dst, out) in x's dtype.
    """
    if root not in ROOTS:
        raise ValueError(f"root must be one of {ROOTS}, got {root!r}")
    if not torch.is_grad_enabled():  # no graph to record (inference): no autograd node, no backward resolved
        return _forward(x, x_dst, weight, root_weight, bias, scale, csr, reduce, norm, root)[0]
    return _ProjectAggregate.apply(x, x_dst, weight, root_weight, bias, scale, csr, reduce, norm, root)


def fusable(x: torch.Tensor, edge_weight: torch.Tensor | None) -> bool:
    """Whether a layer may take the one-node path: no edge weight, and no autocast (whose dtypes the op-by-op
    path follows)."""
    return edge_weight is None and not torch.is_autocast_enabled(x.device.type)
