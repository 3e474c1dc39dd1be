"""CUDA implementation of the aggregation ops: launches the kernels of ``datapath/kernels/aggregate.cu``.

Same contract as `datapath.ops._torch_backend` (which stays the reference).  Kernel
variants are compiled on first use per (element type, vector width, index type).
Neighbor groups and the transpose CSR are built once per graph with torch ops on the
GPU and cached on the graph (`CSRView.cache`).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels
from datapath.ops import _torch_backend as _ref
from datapath.ops._graph import CSRView
from datapath.ops._torch_backend import AggSpec, acc_dtype
from datapath.ops.plan import AggregationPlan, plan_for

log = logging.getLogger("datapath.ops.cuda")

_SOURCE = "aggregate.cu"
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_PUSH_NGS = 1 << 30  # push reads each row once: one group per row
_NULL = np.uint64(0)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when CuPy (the kernel compiler) can be imported."""
    try:
        import cupy  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        log.warning("CuPy is not importable: datapath.ops falls back to the plain-PyTorch path on CUDA")
        return False
    return True


def _fn(name: str, dtype: torch.dtype, vec: int, idx_dtype: torch.dtype) -> Any:
    opts = [f"-DDP_KIND={_KIND[dtype]}", f"-DDP_VEC={vec}"]
    if idx_dtype == torch.int64:
        opts.append("-DDP_IDX_64")
    return kernels.get_function(_SOURCE, name, tuple(opts))


def _p(t: torch.Tensor | None) -> np.uint64:
    return _NULL if t is None else kernels.ptr(t)


@dataclass(eq=False)
class _Groups:
    row: torch.Tensor | None  # (G,) int32 row of each neighbor group; None: implicit groups (see _groups)
    beg: torch.Tensor         # (G,) int64 first CSR position of each group; implicit: (R,) int64 cum
    count: int                # groups the launch covers: G, or an upper bound of it (implicit)
    n_arg: int                # the kernels' n_groups argument: G, or R rows (implicit)
    max_per_row: int          # most groups of one row (implicit: taken as 2, the kernel may combine)
    multi_rows: torch.Tensor | None  # (M,) int64 rows with several groups; None: not known, zero all rows


def _groups(csr: CSRView, which: str, indptr: torch.Tensor, num_rows: int, ngs: int) -> _Groups:
    """Neighbor groups of at most ``ngs`` edges per row, one (empty) group for an empty row (cached).

    Implicit: only ``cum``, the inclusive prefix sum of each row's group count, is built (four
    small ops, no host synchronisation); the kernels find a group's row by binary search in it
    and the launch covers ``num_rows + num_edges // ngs`` groups, at least as many as there are.
    """
    def make() -> _Groups:
        if num_rows == 0:
            e = torch.empty(0, dtype=torch.int64, device=indptr.device)
            return _Groups(e.int(), e, 0, 0, 0, e)
        deg = indptr[1:] - indptr[:-1]
        cum = torch.cumsum(torch.div(deg + (ngs - 1), ngs, rounding_mode="floor").clamp_(min=1), 0)
        return _Groups(None, cum, num_rows + csr.num_edges // ngs, num_rows, 2, None)
    return csr.cached(f"groups_{which}_{ngs}", make)


def prepare(csr: CSRView, feat: int, dtype: torch.dtype, backward: bool,
            plan: AggregationPlan | None) -> list[torch.Tensor]:
    """Build the cached structures `forward` and `backward_x` of a sum/mean aggregation of ``feat``-wide
    ``dtype`` rows will use (neighbor groups; the transpose CSR and its groups), on the current stream,
    so that a training step using them launches only its own kernels (none of this waits for the GPU).
    Returns every tensor now cached on ``csr`` (for ``record_stream`` by a caller on another stream)."""
    p = plan or plan_for(csr.num_edges, csr.num_dst, feat, dtype.itemsize)
    _groups(csr, "f", csr.indptr, csr.num_dst, p.ngs)
    if backward and (plan is None or plan.backward != "atomic"):
        t_indptr = csr.transpose()[0]
        pb = plan or plan_for(csr.num_edges, csr.num_src, feat, dtype.itemsize)
        _groups(csr, "t", t_indptr, csr.num_src, pb.ngs)
    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            for u in v:
                walk(u)
        elif isinstance(v, _Groups):
            out.extend(t for t in (v.row, v.beg, v.multi_rows) if t is not None)

    for v in csr.cache.values():
        walk(v)
    return out


def _sorted_push_groups(t_indptr: torch.Tensor, row_map: torch.Tensor) -> _Groups:
    """One group per transposed row that has edges, visited in ascending table-row order.

    Consecutive warps then read nearby host rows (address-translation locality, as the
    unified gather does), and rows without edges are never read.
    """
    order = torch.argsort(row_map)
    deg = (t_indptr[1:] - t_indptr[:-1]).index_select(0, order)
    order = order[deg > 0]
    e = torch.empty(0, dtype=torch.int64, device=order.device)
    n = int(order.numel())
    return _Groups(order.to(torch.int32), t_indptr.index_select(0, order), n, n, 1, e)


def _plan(spec: AggSpec, num_edges: int, num_rows: int, feat: int, dtype: torch.dtype) -> AggregationPlan:
    if spec.plan is not None:
        if spec.plan.feat_dim != feat:
            raise ValueError(f"the plan is for width {spec.plan.feat_dim} but the features have {feat} columns")
        return spec.plan
    return plan_for(num_edges, num_rows, feat, dtype.itemsize)


def _vec_dw(plan: AggregationPlan, feat: int, head_dim: int, elem: int, *tensors: torch.Tensor) -> tuple[int, int]:
    """The plan's vector width, narrowed until it divides the head width and every row is aligned."""
    vec = plan.vec
    while vec > 1 and (head_dim % vec or feat % vec or any(t.data_ptr() % (vec * elem) for t in tensors)):
        vec //= 2
    if vec == plan.vec:
        return vec, plan.dw
    return vec, min(32, 1 << max(0, (feat // vec - 1).bit_length()))


def _pull(csr: CSRView, which: str, indptr: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor | None,
          num_rows: int, x: torch.Tensor, src_map: torch.Tensor | None, w: torch.Tensor | None, heads: int,
          nbr_scale: torch.Tensor | None, row_scale: torch.Tensor | None, plan: AggregationPlan) -> torch.Tensor:
    """(num_rows, F) accumulation-dtype result of the neighbor-group pull kernel."""
    feat = x.shape[1]
    acc = acc_dtype(x.dtype)
    grp = _groups(csr, which, indptr, num_rows, plan.ngs)
    if grp.count == 0 or feat == 0:
        return torch.zeros(num_rows, feat, dtype=acc, device=x.device)
    # every row is written by its leader team; rows of several groups may be accumulated atomically
    if grp.multi_rows is None:
        out = torch.zeros(num_rows, feat, dtype=acc, device=x.device)
    else:
        out = torch.empty(num_rows, feat, dtype=acc, device=x.device)
        if grp.multi_rows.numel():
            out.index_fill_(0, grp.multi_rows, 0)
    vec, dw = _vec_dw(plan, feat, feat // heads, x.element_size(), x)
    tpb = max(plan.threads_per_block, dw)
    teams = tpb // dw
    combine = 1 if grp.max_per_row > 1 else 0
    smem = (tpb * vec * acc.itemsize + teams * 4) if combine else 0
    blocks = -(-grp.count // teams)
    kern = _fn("agg_pull", x.dtype, vec, indices.dtype)
    kernels.launch(kern, blocks, tpb, (
        _p(indptr), _p(indices), _p(perm), _p(grp.row), _p(grp.beg), np.int64(grp.n_arg), np.int32(plan.ngs),
        _p(x), _p(src_map), _p(w), np.int32(heads), np.int32(feat // heads), _p(nbr_scale), _p(row_scale),
        _p(out), np.int32(feat), np.int32(dw), np.int32(combine)), shared_mem=smem)
    return out


def _push(csr: CSRView, which: str, indptr: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor | None,
          num_rows: int, num_out: int, x: torch.Tensor, row_map: torch.Tensor | None, w: torch.Tensor | None,
          heads: int, nbr_scale: torch.Tensor | None, in_scale: torch.Tensor | None, plan: AggregationPlan,
          ngs: int, align: bool, grp: _Groups | None = None) -> torch.Tensor:
    """(num_out, F) accumulation-dtype result of the scatter kernel (atomics)."""
    feat = x.shape[1]
    acc = acc_dtype(x.dtype)
    out = torch.zeros(num_out, feat, dtype=acc, device=x.device)
    if grp is None:
        grp = _groups(csr, which, indptr, num_rows, ngs)
    if grp.count == 0 or feat == 0:
        return out
    vec, dw = _vec_dw(plan, feat, feat // heads, x.element_size(), x)
    tpb = max(plan.threads_per_block, dw)
    teams = tpb // dw
    kern = _fn("agg_push", x.dtype, vec, indices.dtype)
    kernels.launch(kern, -(-grp.count // teams), tpb, (
        _p(indptr), _p(indices), _p(perm), _p(grp.row), _p(grp.beg), np.int64(grp.n_arg), np.int32(ngs),
        _p(x), _p(row_map), _p(w), np.int32(heads), np.int32(feat // heads), _p(nbr_scale), _p(in_scale),
        _p(out), np.int32(feat), np.int32(dw), np.int32(1 if align else 0)))
    return out


def _acc_weight(weight: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    return None if weight is None else weight.to(acc).contiguous()


def forward(csr: CSRView, x: torch.Tensor, weight: torch.Tensor | None,
            spec: AggSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (num_dst, F) x.dtype, argmax or None)``; see `_torch_backend.forward`."""
    feat = x.shape[1]
    acc = acc_dtype(x.dtype)
    w = _acc_weight(weight, acc)
    plan = _plan(spec, csr.num_edges, csr.num_dst, feat, x.dtype)
    if spec.reduce == "max":
        return _max(csr, x, w, spec, plan)
    fused = plan.fused
    if fused == "auto":
        fused = "push" if spec.table_on_host else "pull"
    if spec.src_ids is not None and fused == "push":
        t_indptr, t_indices, t_perm = csr.transpose()
        out = _push(csr, "t", t_indptr, t_indices, t_perm, csr.num_src, csr.num_dst, x, spec.src_ids, w,
                    spec.heads, None, spec.col_scale, plan, _PUSH_NGS, align=True,
                    grp=_sorted_push_groups(t_indptr, spec.src_ids))
        if spec.row_scale is not None:
            out.mul_(spec.row_scale.unsqueeze(1))
    else:
        out = _pull(csr, "f", csr.indptr, csr.indices, None, csr.num_dst, x, spec.src_ids, w, spec.heads,
                    spec.col_scale, spec.row_scale, plan)
    return out.to(x.dtype), None


def _max(csr: CSRView, x: torch.Tensor, w: torch.Tensor | None, spec: AggSpec,
         plan: AggregationPlan) -> tuple[torch.Tensor, torch.Tensor]:
    feat = x.shape[1]
    out = torch.empty(csr.num_dst, feat, dtype=x.dtype, device=x.device)
    argmax = torch.empty(csr.num_dst, feat, dtype=torch.int64, device=x.device)
    if csr.num_dst == 0 or feat == 0:
        return out, argmax
    vec, dw = _vec_dw(plan, feat, feat // spec.heads, x.element_size(), x)
    tpb = max(plan.threads_per_block, dw)
    teams = tpb // dw
    kern = _fn("agg_max", x.dtype, vec, csr.indices.dtype)
    kernels.launch(kern, -(-csr.num_dst // teams), tpb, (
        _p(csr.indptr), _p(csr.indices), np.int64(csr.num_dst), _p(x), _p(spec.src_ids), _p(w),
        np.int32(spec.heads), np.int32(feat // spec.heads), _p(out), _p(argmax), np.int32(feat), np.int32(dw)))
    return out, argmax


def backward_x(csr: CSRView, grad_out: torch.Tensor, weight: torch.Tensor | None, spec: AggSpec,
               argmax: torch.Tensor | None, x_dtype: torch.dtype) -> torch.Tensor:
    """(num_src, F) gradient of x: pull over the cached transpose CSR, or atomic scatter (plan.backward)."""
    if spec.reduce == "max":
        return _ref.backward_x(csr, grad_out, weight, spec, argmax, x_dtype)
    feat = grad_out.shape[1]
    acc = acc_dtype(grad_out.dtype)
    w = _acc_weight(weight, acc)
    g = grad_out.contiguous()
    if spec.plan is not None and spec.plan.backward == "atomic":
        out = _push(csr, "f", csr.indptr, csr.indices, None, csr.num_dst, csr.num_src, g, None, w, spec.heads,
                    spec.col_scale, spec.row_scale, spec.plan, spec.plan.ngs, align=False)
    else:
        t_indptr, t_indices, t_perm = csr.transpose()
        plan = spec.plan
        if plan is None:
            plan = plan_for(csr.num_edges, csr.num_src, feat, g.element_size())
        out = _pull(csr, "t", t_indptr, t_indices, t_perm, csr.num_src, g, None, w, spec.heads,
                    spec.row_scale, spec.col_scale, plan)
    return out.to(x_dtype)


def _sddmm(csr: CSRView, a: torch.Tensor, b: torch.Tensor, b_map: torch.Tensor | None, heads: int,
           row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(E, heads) scale * <a[dst], b[map(src)]> per head; a (num_dst, F), b (rows, F), F = heads * D."""
    feat = a.shape[1]
    d = feat // heads
    out = torch.empty(csr.num_edges, heads, dtype=a.dtype, device=a.device)
    if csr.num_edges == 0:
        return out.to(out_dtype)
    plan = plan_for(csr.num_edges, csr.num_dst, feat, a.element_size())
    grp = _groups(csr, "f", csr.indptr, csr.num_dst, plan.ngs)
    dw = min(32, 1 << max(0, (d - 1).bit_length()))
    tpb = 128
    kern = _fn("sddmm_dot", a.dtype, 1, csr.indices.dtype)
    kernels.launch(kern, -(-grp.count // (tpb // dw)), tpb, (
        _p(csr.indptr), _p(csr.indices), _p(grp.row), _p(grp.beg), np.int64(grp.n_arg), np.int32(plan.ngs),
        _p(a), _p(b), _p(b_map), _p(row_scale), _p(col_scale), np.int32(heads), np.int32(d), _p(out),
        np.int32(dw)))
    return out.to(out_dtype)


def backward_weight(csr: CSRView, x: torch.Tensor, grad_out: torch.Tensor, spec: AggSpec,
                    argmax: torch.Tensor | None, w_dtype: torch.dtype) -> torch.Tensor:
    """(E, H) gradient of the edge weight (SDDMM of the output gradient and the source rows)."""
    if spec.reduce == "max":
        return _ref.backward_weight(csr, x, grad_out, spec, argmax, w_dtype)
    g = grad_out.contiguous()
    if g.dtype != x.dtype:
        g = g.to(x.dtype)
    return _sddmm(csr, g, x, spec.src_ids, spec.heads, spec.row_scale, spec.col_scale, w_dtype)


def sddmm_dot(csr: CSRView, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(E, H) per-edge, per-head dot products of ``a[dst]`` (num_dst, H, D) and ``b[src]`` (num_src, H, D)."""
    heads = a.shape[1]
    return _sddmm(csr, a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1), None, heads, None, None, a.dtype)


def edge_softmax(csr: CSRView, scores: torch.Tensor) -> torch.Tensor:
    """(E, H) softmax over each row's edges."""
    out = torch.empty_like(scores)
    if csr.num_edges == 0 or csr.num_dst == 0:
        return out
    kern = _fn("edge_softmax_fwd", scores.dtype, 1, csr.indices.dtype)
    kernels.launch(kern, -(-csr.num_dst // 4), 128, (
        _p(csr.indptr), np.int64(csr.num_dst), np.int32(scores.shape[1]), _p(scores), _p(out)))
    return out


def edge_softmax_backward(csr: CSRView, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(E, H) gradient of the scores."""
    out = torch.empty_like(p)
    if csr.num_edges == 0 or csr.num_dst == 0:
        return out
    g = grad.to(p.dtype).contiguous()
    kern = _fn("edge_softmax_bwd", p.dtype, 1, csr.indices.dtype)
    kernels.launch(kern, -(-csr.num_dst // 4), 128, (
        _p(csr.indptr), np.int64(csr.num_dst), np.int32(p.shape[1]), _p(p), _p(g), _p(out)))
    return out
