"""Per-edge ops for attention models: ``sddmm`` (edge scores from endpoint features) and ``edge_softmax``."""
from __future__ import annotations

from typing import Any

import torch

from datapath.ops import _inputs
from datapath.ops._graph import CSRView, as_csr
from datapath.ops._torch_backend import AggSpec
from datapath.ops.errors import FeatureShapeError

SDDMM_OPS = ("dot", "add", "mul")


class _SddmmDotFn(torch.autograd.Function):
    """scores[e, h] = <a[dst_e, h], b[src_e, h]>; the gradients are aggregations weighted by the score gradient."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, csr: CSRView, backend: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.csr, ctx.backend = csr, backend
        ctx.save_for_backward(a, b)
        return backend.sddmm_dot(csr, a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        csr, backend = ctx.csr, ctx.backend
        heads, d = a.shape[1], a.shape[2]
        spec = AggSpec("sum", None, None, heads, None)
        g = grad.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:  # grad_a[d] = sum_e g[e] * b[src_e]
            grad_a = backend.forward(csr, b.reshape(b.shape[0], heads * d), g, spec)[0].view(-1, heads, d)
        if ctx.needs_input_grad[1]:  # grad_b[s] = sum_e g[e] * a[dst_e]
            grad_b = backend.backward_x(csr, a.reshape(a.shape[0], heads * d), g, spec, None, b.dtype).view(
                -1, heads, d)
        return grad_a, grad_b, None, None


def _segment_sum(index: torch.Tensor, values: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, ...) sums of ``values`` (E, ...) by ``index`` (E,), accumulated in float32 (float64 for float64)."""
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    out = torch.zeros((rows, *values.shape[1:]), dtype=acc, device=values.device)
    return out.index_add_(0, index, values.to(acc)).to(values.dtype)


class _SddmmEltFn(torch.autograd.Function):
    """scores[e] = a[dst_e] + b[src_e] (``add``) or a[dst_e] * b[src_e] (``mul``); the gradients sum each node's edges
    in float32 (float64), not in the 16-bit dtype of the features (what index_select's own backward would do)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, csr: CSRView, op: str) -> torch.Tensor:  # type: ignore[override]
        dst, src = csr.edge_dst(), csr.indices64()
        ea, eb = a.index_select(0, dst), b.index_select(0, src)
        ctx.csr, ctx.op = csr, op
        ctx.save_for_backward(a if op == "mul" else None, b if op == "mul" else None)
        return ea + eb if op == "add" else ea * eb

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        csr = ctx.csr
        dst, src = csr.edge_dst(), csr.indices64()
        grad_a = grad_b = None
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        if ctx.needs_input_grad[0]:
            ga = grad if ctx.op == "add" else grad.to(acc) * b.index_select(0, src).to(acc)
            grad_a = _segment_sum(dst, ga, csr.num_dst).to(grad.dtype)
        if ctx.needs_input_grad[1]:
            gb = grad if ctx.op == "add" else grad.to(acc) * a.index_select(0, dst).to(acc)
            grad_b = _segment_sum(src, gb, csr.num_src).to(grad.dtype)
        return grad_a, grad_b, None, None


class _EdgeSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, csr: CSRView, backend: Any) -> torch.Tensor:  # type: ignore[override]
        p = backend.edge_softmax(csr, scores)
        ctx.csr, ctx.backend = csr, backend
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        return ctx.backend.edge_softmax_backward(ctx.csr, p, grad.contiguous()), None, None


def _as_heads(t: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    """(N, D) -> (N, 1, D) (flag True: squeeze the head axis of the result); (N, H, D) unchanged."""
    _inputs.check_float(t, what)
    if t.dim() == 2:
        return t.unsqueeze(1), True
    if t.dim() == 3:
        return t, False
    raise FeatureShapeError(f"{what} must be (N, D) or (N, H, D), got shape {tuple(t.shape)}")


def sddmm(graph: Any, a: torch.Tensor, b: torch.Tensor, op: str = "dot") -> torch.Tensor:
    """Per-edge values from the features of both endpoints (sampled dense-dense product).

    Args:
        graph: a CSR of destination rows (see `aggregate`).
        a: destination-side features, (num_dst, D) or (num_dst, H, D).
        b: source-side features, (num_src, D) or (num_src, H, D) (same trailing shape as ``a``).
        op: ``"dot"``: ``<a[dst], b[src]>`` over the last axis, giving (E,) or (E, H);
            ``"add"`` / ``"mul"``: elementwise ``a[dst] + b[src]`` / ``a[dst] * b[src]``, giving (E, ...).
    Returns:
        values per CSR position, a's dtype and device; differentiable in ``a`` and ``b``.
    """
    if op not in SDDMM_OPS:
        raise ValueError(f"op must be one of {SDDMM_OPS}, got {op!r}")
    csr = as_csr(graph)
    _inputs.check_float(a, "a")
    _inputs.check_float(b, "b")
    _inputs.check_graph_device(csr, a.device)
    _inputs.check_device(b, a.device, "b")
    if a.dtype != b.dtype:
        raise FeatureShapeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.shape[0] != csr.num_dst or b.shape[0] != csr.num_src:
        raise FeatureShapeError(
            f"a must have num_dst_nodes={csr.num_dst} rows and b num_src_nodes={csr.num_src} rows; "
            f"got {a.shape[0]} and {b.shape[0]}"
        )
    if a.shape[1:] != b.shape[1:]:
        raise FeatureShapeError(f"a and b must agree after the node axis, got {tuple(a.shape)} and {tuple(b.shape)}")
    if op != "dot":
        return _SddmmEltFn.apply(a, b, csr, op)
    a3, squeeze = _as_heads(a, "a")
    b3, _ = _as_heads(b, "b")
    out = _SddmmDotFn.apply(a3.contiguous(), b3.contiguous(), csr, _inputs.backend_for(a.device))
    return out.squeeze(1) if squeeze else out


def edge_softmax(graph: Any, scores: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` over the incoming edges of each destination row.

    Args:
        graph: a CSR of destination rows (see `aggregate`).
        scores: (E,) or (E, H) float, one per CSR position (and head).
    Returns:
        same shape, dtype and device; each row's entries sum to 1 (computed in float32); differentiable.
    """
    csr = as_csr(graph)
    _inputs.check_float(scores, "scores")
    _inputs.check_graph_device(csr, scores.device)
    if scores.dim() not in (1, 2) or scores.shape[0] != csr.num_edges:
        raise FeatureShapeError(
            f"scores must be (E,) or (E, H) with E={csr.num_edges} (the graph's edges), got {tuple(scores.shape)}"
        )
    s2 = scores.reshape(csr.num_edges, scores.shape[1] if scores.dim() == 2 else 1).contiguous()  # E may be 0
    out = _EdgeSoftmaxFn.apply(s2, csr, _inputs.backend_for(scores.device))
    return out.view(scores.shape)
