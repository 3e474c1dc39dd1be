"""CUDA implementation of the aggregation ops: picks and launches the kernels.

Same contract as `datapath.ops._torch_backend` (which stays the reference).  The sum family
(sum, mean, GCN norm, edge weights) runs the plan chosen per graph (`datapath.ops._tune`):
``rows``, ``tensor_core`` and ``cusparse`` (`datapath.ops._spmm`) or ``groups`` (GNNAdvisor's
neighbor groups, here, from ``aggregate.cu``); the gradient of x is the same aggregation over
the transposed CSR, built once per graph, with a plan of its own.  Max aggregation, the fused
push over a host table, SDDMM and edge softmax have one kernel each (``aggregate.cu``).
Nothing here synchronises with the host, except a graph's first probe (see `_tune`).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from datapath.ops import _checks, _launch, _spmm, _tune
from datapath.ops import _torch_backend as _ref
from datapath.ops._graph import CSRView
from datapath.ops._launch import ptr as _p
from datapath.ops._torch_backend import AggSpec, acc_dtype
from datapath.ops.plan import AggregationPlan, plan_for

log = logging.getLogger("datapath.ops.cuda")

_SOURCE = "aggregate.cu"
_PUSH_NGS = 1 << 30  # push reads each row once: one group per row


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
    return _launch.function(_SOURCE, name, _launch.options(dtype, vec, idx_dtype, *_checks.kernel_options()))


def _go(kern: Any, grid: int, block: int, args: tuple, device: torch.device, shared_mem: int = 0) -> None:
    _launch.launch(kern, grid, block, args, device.index, shared_mem)


@dataclass(eq=False)
class _Groups:
    row: torch.Tensor | None  # (G,) int32 row of each neighbor group; None: implicit groups (see _groups)
    beg: torch.Tensor         # (G,) int64 first CSR position of each group; implicit: (R,) int64 cum
    count: int                # groups the launch covers: G, or an upper bound of it (implicit)
    n_arg: int                # the kernels' n_groups argument: G, or R rows (implicit)
    max_per_row: int          # most groups of one row (implicit: taken as 2, the kernel may combine)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.row, self.beg) if t is not None]


def _groups(view: CSRView, ngs: int) -> _Groups:
    """Neighbor groups of at most ``ngs`` edges per row, one (empty) group for an empty row (cached).

    Implicit: only ``cum``, the inclusive prefix sum of each row's group count, is built (four
    small ops, no host synchronisation); the kernels find a group's row by binary search in it
    and the launch covers ``num_rows + num_edges // ngs`` groups, at least as many as there are.
    """
    def make() -> _Groups:
        n = view.num_dst
        if n == 0:
            e = torch.empty(0, dtype=torch.int64, device=view.device)
            return _Groups(e.int(), e, 0, 0, 0)
        deg = view.in_degrees()
        cum = torch.cumsum(torch.div(deg + (ngs - 1), ngs, rounding_mode="floor").clamp_(min=1), 0)
        return _Groups(None, cum, n + view.num_edges // ngs, n, 2)
    return view.cached(("groups", ngs), make)


def _schedule(view: CSRView, plan: AggregationPlan, dtype: torch.dtype) -> None:
    """Build what ``plan``'s kernel reads for ``view`` and its launch for aligned rows (cached; no host
    synchronisation except the tensor-core translation)."""
    if plan.kernel == "groups":
        _pull_launch(view, dtype, plan.feat_dim, 1, plan, plan.vec, plan.dw)
    elif plan.kernel == "rows":
        _spmm.rows_launch(view, dtype, plan.feat_dim, plan.vec, plan.dw, plan.cf, plan)
    elif plan.kernel == "tensor_core" and _spmm.tensor_core_ok(dtype):
        _spmm.translation(view, dtype)
    elif plan.kernel == "cusparse":
        _spmm._csr_index(view)


def prepare(csr: CSRView, feat: int, dtype: torch.dtype, backward: bool, plan: AggregationPlan | None,
            spec: AggSpec) -> list[torch.Tensor]:
    """Build, on the current stream, what a sum-family aggregation of ``feat``-wide ``dtype`` rows over
    ``csr`` will read (the plan's schedule and bound launch; for ``backward``, the transposed CSR and its
    schedule and launch), so that a training step using them launches only its own kernels.  Returns every
    tensor kept with the graph (for ``record_stream`` by a caller on another stream)."""
    variant = spec.variant
    p = plan or _tune.choose(csr, feat, dtype, variant, False, 1)
    _schedule(csr, p, dtype)
    if plan is None:
        _forward_runner(csr, spec, p, feat, dtype)
    if backward and p.backward != "atomic":
        t = csr.transposed()
        pt = plan or _tune.choose(t, feat, dtype, variant, False, 1)
        _schedule(t, pt, dtype)
        if plan is None:
            transposed_runner(csr, spec, feat, dtype)
    return csr.tensors()


def _push_order(view: CSRView, row_map: torch.Tensor) -> _Groups:
    """One group per row of ``view``, visited in ascending ``row_map`` (table row) order.

    Consecutive warps then read nearby host rows (address-translation locality, as the
    unified gather does); the kernel skips rows without edges without reading them.
    """
    order = torch.argsort(row_map)
    n = int(order.numel())
    return _Groups(order.to(torch.int32), view.indptr.index_select(0, order), n, n, 1)


def _kept_push_order(t: CSRView, ids: torch.Tensor) -> _Groups:
    """`_push_order` of ``ids`` over ``t``, kept while ``ids`` lives and is unmodified: keyed by the ids tensor
    itself (weakly, by identity: the entry goes with it), never by its address, which a later ids tensor may reuse.
    (A plain WeakKeyDictionary compares tensor keys with ``==``, elementwise: it cannot hold tensors.)"""
    kept = t.cached("push_orders", WeakIdKeyDictionary)
    hit = kept.get(ids)
    if hit is not None and hit[0] == ids._version:
        return hit[1]
    order = _push_order(t, ids)
    kept[ids] = (ids._version, order)
    return order


def _plan_of(spec: AggSpec, feat: int) -> AggregationPlan:
    if spec.plan.feat_dim != feat:
        raise ValueError(f"the plan is for width {spec.plan.feat_dim} but the features have {feat} columns")
    return spec.plan


def _vec_dw(plan: AggregationPlan, feat: int, head_dim: int, elem: int, *tensors: torch.Tensor) -> tuple[int, int]:
    """The plan's vector width, narrowed until it divides the head width and every row is aligned."""
    vec = plan.vec
    while vec > 1 and (head_dim % vec or feat % vec or any(t.data_ptr() % (vec * elem) for t in tensors)):
        vec //= 2
    if vec == plan.vec:
        return vec, plan.dw
    return vec, min(32, 1 << max(0, (feat // vec - 1).bit_length()))


def _pull_launch(view: CSRView, dtype: torch.dtype, feat: int, heads: int, plan: AggregationPlan, vec: int,
                 dw: int) -> tuple[_launch.PackedLaunch | None, bool]:
    """The neighbor-group pull's launch for this view and layout (kept with the view)."""
    def make() -> tuple[_launch.PackedLaunch | None, bool]:
        grp = _groups(view, plan.ngs)
        if grp.count == 0:
            return None, False
        acc = acc_dtype(dtype)
        tpb = max(plan.threads_per_block, dw)
        teams = tpb // dw
        combine = 1 if grp.max_per_row > 1 else 0
        smem = (tpb * vec * acc.itemsize + teams * 4) if combine else 0
        # the view's CSR and the groups passed as tensors: the launch holds what it reads (see PackedLaunch)
        args = (view.indptr, view.indices, view.edge_perm, grp.row, grp.beg, np.int64(grp.n_arg),
                np.int32(plan.ngs), None, None, None, np.int32(heads), np.int32(feat // heads), None, None, None,
                np.int32(feat), np.int32(dw), np.int32(combine))
        fn = _fn("agg_pull", dtype, vec, view.indices.dtype)
        return _launch.PackedLaunch(fn, (-(-grp.count // teams),), tpb, args, (7, 8, 9, 12, 13, 14), smem), True
    return view.cached(("pull_launch", dtype, feat, heads, plan.ngs, vec, dw, plan.threads_per_block,
                        _checks.kernel_options()), make)


def _pull(view: CSRView, x: torch.Tensor, src_map: torch.Tensor | None, w: torch.Tensor | None, heads: int,
          nbr_scale: torch.Tensor | None, row_scale: torch.Tensor | None, plan: AggregationPlan) -> torch.Tensor:
    """(num_dst, F) accumulation-dtype result of the neighbor-group pull kernel (GNNAdvisor)."""
    feat = x.shape[1]
    out = torch.zeros(view.num_dst, feat, dtype=acc_dtype(x.dtype), device=x.device)  # rows of several groups add
    if feat == 0 or view.num_dst == 0:
        return out
    if src_map is None and x.shape[0] != view.num_src:
        raise _checks.rows_error(x, (view.num_src, feat), x.dtype, "aggregation rows")
    if _checks._DEBUG[0]:  # noqa: SLF001
        _checks.validate_csr(view.indptr, view.indices, view.num_src, view.num_dst, view.edge_perm, "the pull's CSR")
        if src_map is not None:
            _checks.validate_ids(src_map[: view.num_src], x.shape[0], "src_map")
    vec, dw = _vec_dw(plan, feat, feat // heads, x.element_size(), x)
    launch, ok = _pull_launch(view, x.dtype, feat, heads, plan, vec, dw)
    if ok:
        launch(x.device.index, x, src_map, w, nbr_scale, row_scale, out)
    return out


def _push(view: CSRView, num_out: int, x: torch.Tensor, row_map: torch.Tensor | None, w: torch.Tensor | None,
          heads: int, nbr_scale: torch.Tensor | None, in_scale: torch.Tensor | None, plan: AggregationPlan,
          ngs: int, align: bool, grp: _Groups | None = None) -> torch.Tensor:
    """(num_out, F) accumulation-dtype result of the scatter kernel: every row of ``view`` pushes
    ``in_scale[r] * x[map(r)]`` to its neighbours (atomics)."""
    feat = x.shape[1]
    if num_out != view.num_src or (row_map is None and x.shape[0] != view.num_dst) or (
            row_map is not None and row_map.numel() < view.num_dst):
        raise _checks.rows_error(x, (view.num_dst, feat), x.dtype, f"scatter rows (into {num_out} outputs)")
    if _checks._DEBUG[0]:  # noqa: SLF001
        _checks.validate_csr(view.indptr, view.indices, view.num_src, view.num_dst, view.edge_perm, "the push's CSR")
        if row_map is not None:
            _checks.validate_ids(row_map[: view.num_dst], x.shape[0], "src_ids")
    acc = acc_dtype(x.dtype)
    out = torch.zeros(num_out, feat, dtype=acc, device=x.device)
    if grp is None:
        grp = _groups(view, ngs)
    if grp.count == 0 or feat == 0:
        return out
    vec, dw = _vec_dw(plan, feat, feat // heads, x.element_size(), x)
    tpb = max(plan.threads_per_block, dw)
    teams = tpb // dw
    kern = _fn("agg_push", x.dtype, vec, view.indices.dtype)
    _go(kern, -(-grp.count // teams), tpb, (
        _p(view.indptr), _p(view.indices), _p(view.edge_perm), _p(grp.row), _p(grp.beg), np.int64(grp.n_arg),
        np.int32(ngs), _p(x), _p(row_map), _p(w), np.int32(heads), np.int32(feat // heads), _p(nbr_scale),
        _p(in_scale), _p(out), np.int32(feat), np.int32(dw), np.int32(1 if align else 0)), x.device)
    return out


def _acc_weight(weight: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    return None if weight is None else weight.to(acc).contiguous()


def sum_forward(view: CSRView, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
                row_scale: torch.Tensor | None, plan: AggregationPlan, heads: int = 1,
                src_map: torch.Tensor | None = None) -> torch.Tensor:
    """(num_dst, F) x.dtype: the sum-family aggregation over ``view`` by ``plan``'s kernel (see `_spmm`)."""
    k = plan.kernel
    if heads != 1 or k == "groups":
        return _pull(view, x, src_map, w, heads, nbr_scale, row_scale, plan).to(x.dtype)
    if k == "rows" or src_map is not None:
        return _spmm.rows(view, x, w, nbr_scale, row_scale, plan if k == "rows" else plan.replace(kernel="rows"),
                          src_map)
    if k == "tensor_core":
        return _spmm.tensor_core(view, x, w, nbr_scale, row_scale, plan)
    return _spmm.cusparse(view, x, w, nbr_scale, row_scale)


def _fused(csr: CSRView, x: torch.Tensor, w: torch.Tensor | None, spec: AggSpec) -> torch.Tensor:
    """Aggregation of ``x[src_ids]`` without materialising it (a host table, or a GPU one)."""
    feat = x.shape[1]
    plan = _plan_of(spec, feat) if spec.plan is not None else plan_for(
        csr.num_edges, csr.num_dst, feat, x.element_size())
    fused = plan.fused
    if fused == "auto":
        fused = "push" if spec.table_on_host else "pull"
    if fused == "pull":
        return sum_forward(csr, x, w, spec.col_scale, spec.row_scale, plan.replace(kernel="rows"), spec.heads,
                           src_map=spec.src_ids)
    t = csr.transposed()
    ids = spec.src_ids
    order = _kept_push_order(t, ids)
    out = _push(t, csr.num_dst, x, ids, w, spec.heads, None, spec.col_scale, plan, _PUSH_NGS, align=True, grp=order)
    if spec.row_scale is not None:
        out.mul_(spec.row_scale.unsqueeze(1))
    return out.to(x.dtype)


def forward(csr: CSRView, x: torch.Tensor, weight: torch.Tensor | None,
            spec: AggSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out (num_dst, F) x.dtype, argmax or None)``; see `_torch_backend.forward`."""
    feat = x.shape[1]
    w = _acc_weight(weight, acc_dtype(x.dtype))
    if spec.reduce == "max":
        plan = _plan_of(spec, feat) if spec.plan is not None else plan_for(
            csr.num_edges, csr.num_dst, feat, x.element_size())
        return _max(csr, x, w, spec, plan)
    if spec.src_ids is not None:
        return _fused(csr, x, w, spec), None
    if spec.plan is not None:
        plan = _plan_of(spec, feat)
    else:
        weighted = w is not None
        plan = csr.cache.get(_tune.plan_key(feat, x.dtype, spec.variant, weighted, spec.heads))
        if plan is None:
            allow = spec.heads == 1 and _tune.may_probe(csr)
            wd = weight.detach() if weight is not None else None
            plan = _tune.choose(csr, feat, x.dtype, spec.variant, weighted, spec.heads, allow_probe=allow,
                                run=_tune.public_call(csr, x.detach(), spec.variant, wd))
            if allow and spec.grad_x:  # the gradient's plan too, so that the backward never waits
                t = csr.transposed()
                g = torch.randn(csr.num_dst, feat, device=x.device).to(x.dtype)
                _tune.choose(t, feat, x.dtype, spec.variant, weighted, 1, allow_probe=True,
                             run=_tune.public_call(t, g, "sum", wd))
        if w is None and spec.heads == 1:  # the common call: its launch bound once
            return _forward_runner(csr, spec, plan, feat, x.dtype)(x), None
    return sum_forward(csr, x, w, spec.col_scale, spec.row_scale, plan, spec.heads), None


def _max(csr: CSRView, x: torch.Tensor, w: torch.Tensor | None, spec: AggSpec,
         plan: AggregationPlan) -> tuple[torch.Tensor, torch.Tensor]:
    feat = x.shape[1]
    out = torch.empty(csr.num_dst, feat, dtype=x.dtype, device=x.device)
    argmax = torch.empty(csr.num_dst, feat, dtype=torch.int64, device=x.device)
    if csr.num_dst == 0 or feat == 0:
        return out, argmax
    if spec.src_ids is None and x.shape[0] != csr.num_src:
        raise _checks.rows_error(x, (csr.num_src, feat), x.dtype, "max-aggregation rows")
    if _checks._DEBUG[0]:  # noqa: SLF001
        _checks.validate_csr(csr.indptr, csr.indices, csr.num_src, csr.num_dst, None, "the max's CSR")
        if spec.src_ids is not None:
            _checks.validate_ids(spec.src_ids[: csr.num_src], x.shape[0], "src_ids")
    vec, dw = _vec_dw(plan, feat, feat // spec.heads, x.element_size(), x)
    tpb = max(plan.threads_per_block, dw)
    teams = tpb // dw
    kern = _fn("agg_max", x.dtype, vec, csr.indices.dtype)
    _go(kern, -(-csr.num_dst // teams), tpb, (
        _p(csr.indptr), _p(csr.indices), np.int64(csr.num_dst), _p(x), _p(spec.src_ids), _p(w),
        np.int32(spec.heads), np.int32(feat // spec.heads), _p(out), _p(argmax), np.int32(feat), np.int32(dw)),
        x.device)
    return out, argmax


def transposed_runner(csr: CSRView, spec: AggSpec, feat: int, dtype: torch.dtype) -> Any:
    """``run(g)``: the unweighted sum-family aggregation of ``g`` (num_dst, feat) ``dtype`` over the transposed
    CSR (the gradient of x), its plan and kernel resolved here once (probed with the graph, as the forward's),
    so that a backward calls a kernel with no lookups.  Kept with ``csr`` (not the transposed view: no cycle)."""
    t = csr.transposed()
    plan = t.cache.get(_tune.plan_key(feat, dtype, spec.variant, False, 1))
    if plan is None:
        allow = _tune.may_probe(csr)
        g = torch.randn(csr.num_dst, feat, device=csr.device).to(dtype) if allow else None
        plan = _tune.choose(t, feat, dtype, spec.variant, False, 1, allow_probe=allow,
                            run=_tune.public_call(t, g, "sum", None) if allow else None)
    # the forward's row scale applies to the transpose's sources, its column scale to the transpose's rows; the
    # runner holds the transposed view (it is kept with csr and by autograd nodes, which may outlive csr)
    return _kept_runner(csr, ("t_runner", feat, dtype, spec.variant), plan,
                        lambda: _bound(t, plan, feat, dtype, spec.row_scale, spec.col_scale, strong=True))


def _kept_runner(csr: CSRView, key: tuple, plan: AggregationPlan, make: Any) -> Any:
    """The runner kept in ``csr``'s cache under ``key`` for ``plan``; ``make()`` builds it when absent or stale."""
    hit = csr.cache.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    run = make()
    csr.cache[key] = (plan, run)
    return run


def _bound(view: CSRView, plan: AggregationPlan, feat: int, dtype: torch.dtype, nbr: torch.Tensor | None,
           row: torch.Tensor | None, strong: bool = False, check: bool = True) -> Any:
    """``run(x)`` by ``plan`` over ``view``; ``strong``: the runner holds the view (see `_spmm.view_ref`);
    ``check``: it checks each x (see `_spmm.bound`)."""
    run = _spmm.bound(view, plan, feat, dtype, nbr, row, strong, check)
    if run is not None:
        return run
    get = _spmm.view_ref(view, strong)
    if plan.kernel == "groups" and view.num_dst > 0 and feat > 0:
        return _bound_pull(view, get, plan, feat, dtype, nbr, row, check)
    return lambda x: sum_forward(get(), x, None, nbr, row, plan)


def _bound_pull(view: CSRView, get: Any, plan: AggregationPlan, feat: int, dtype: torch.dtype,
                nbr: torch.Tensor | None, row: torch.Tensor | None, check: bool = True) -> Any:
    """``run(x)`` of the neighbor-group pull for aligned rows, its launch resolved here: a call allocates the
    output and launches (a short call on a small graph is bound by this host work).  Where every row is one
    group (no row longer than ``ngs``), each row is written once by its own team: no zero-fill."""
    vec, dw = _vec_dw(plan, feat, feat, dtype.itemsize)  # the widths an aligned x gets from `_pull`
    launch_, ok = _pull_launch(view, dtype, feat, 1, plan, vec, dw)
    acc = acc_dtype(dtype)
    n, align, dev = view.num_dst, vec * dtype.itemsize, view.device
    zero = view.max_degree is None or view.max_degree > plan.ngs
    alloc = torch.zeros if zero else torch.empty
    cast = acc != dtype
    shape = torch.Size((view.num_src, feat))

    def run(x: torch.Tensor) -> torch.Tensor:
        if check and (x.shape != shape or x.dtype != dtype or not x.is_contiguous()):
            raise _checks.rows_error(x, tuple(shape), dtype, "aggregation rows")
        if x.data_ptr() % align or not ok:
            return sum_forward(get(), x, None, nbr, row, plan)
        if _checks._DEBUG[0]:  # noqa: SLF001
            v = get()
            _checks.validate_csr(v.indptr, v.indices, v.num_src, n, v.edge_perm, "the pull's CSR")
        out = alloc((n, feat), dtype=acc, device=dev)
        launch_(dev.index, x, None, None, nbr, row, out)
        return out.to(dtype) if cast else out
    return run


def _forward_runner(csr: CSRView, spec: AggSpec, plan: AggregationPlan, feat: int, dtype: torch.dtype) -> Any:
    """The unweighted forward by ``plan``, bound once per (width, dtype, variant, plan) and kept with ``csr``."""
    # its rows are aggregate's, validated there (rows, width, contiguity; the dtype is in the key): no check per call
    return _kept_runner(csr, ("f_runner", feat, dtype, spec.variant), plan,
                        lambda: _bound(csr, plan, feat, dtype, spec.col_scale, spec.row_scale, check=False))


def backward_x(csr: CSRView, grad_out: torch.Tensor, weight: torch.Tensor | None, spec: AggSpec,
               argmax: torch.Tensor | None, x_dtype: torch.dtype) -> torch.Tensor:
    """(num_src, F) gradient of x: the aggregation over the cached transposed CSR, or atomic scatter."""
    if spec.reduce == "max":
        return _ref.backward_x(csr, grad_out, weight, spec, argmax, x_dtype)
    feat = grad_out.shape[1]
    g = grad_out.contiguous()
    w = _acc_weight(weight, acc_dtype(g.dtype))
    if spec.plan is not None and spec.plan.backward == "atomic":
        out = _push(csr, csr.num_src, g, None, w, spec.heads, spec.col_scale, spec.row_scale, spec.plan,
                    spec.plan.ngs, align=False)
        return out.to(x_dtype)
    t = csr.transposed()
    if spec.plan is not None:
        plan = _plan_of(spec, feat)
    else:
        weighted = w is not None
        plan = t.cache.get(_tune.plan_key(feat, g.dtype, spec.variant, weighted, spec.heads))
        if plan is None:  # no forward probed it (e.g. `aggregate_transposed` in a layer's own backward): once here
            allow = spec.heads == 1 and _tune.may_probe(csr)
            run = _tune.public_call(t, g, "sum", weight.detach() if weight is not None else None) if allow else None
            plan = _tune.choose(t, feat, g.dtype, spec.variant, weighted, spec.heads, run=run, allow_probe=allow)
    return sum_forward(t, g, w, spec.row_scale, spec.col_scale, plan, spec.heads).to(x_dtype)


def _sddmm(csr: CSRView, a: torch.Tensor, b: torch.Tensor, b_map: torch.Tensor | None, heads: int,
           row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(E, heads) scale * <a[dst], b[map(src)]> per head; a (num_dst, F), b (rows, F), F = heads * D."""
    feat = a.shape[1]
    d = feat // heads
    out = torch.empty(csr.num_edges, heads, dtype=a.dtype, device=a.device)
    if csr.num_edges == 0:
        return out.to(out_dtype)
    if a.shape[0] != csr.num_dst or b.shape[1] != feat or (b_map is None and b.shape[0] != csr.num_src):
        raise _checks.rows_error(b, (csr.num_src, feat), b.dtype, f"SDDMM rows (a: {tuple(a.shape)})")
    if _checks._DEBUG[0]:  # noqa: SLF001
        _checks.validate_csr(csr.indptr, csr.indices, csr.num_src, csr.num_dst, None, "the SDDMM's CSR")
    plan = plan_for(csr.num_edges, csr.num_dst, feat, a.element_size())
    grp = _groups(csr, plan.ngs)
    dw = min(32, 1 << max(0, (d - 1).bit_length()))
    tpb = 128
    kern = _fn("sddmm_dot", a.dtype, 1, csr.indices.dtype)
    _go(kern, -(-grp.count // (tpb // dw)), tpb, (
        _p(csr.indptr), _p(csr.indices), _p(grp.row), _p(grp.beg), np.int64(grp.n_arg), np.int32(plan.ngs),
        _p(a), _p(b), _p(b_map), _p(row_scale), _p(col_scale), np.int32(heads), np.int32(d), _p(out),
        np.int32(dw)), a.device)
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
    width = a.shape[1] * a.shape[2]  # explicit: a reshape to (0, -1) of an empty tensor is ambiguous
    return _sddmm(csr, a.reshape(a.shape[0], width), b.reshape(b.shape[0], width), None, heads, None, None, a.dtype)


def edge_softmax(csr: CSRView, scores: torch.Tensor) -> torch.Tensor:
    """(E, H) softmax over each row's edges."""
    out = torch.empty_like(scores)
    if csr.num_edges == 0 or csr.num_dst == 0:
        return out
    if scores.dim() != 2 or scores.shape[0] != csr.num_edges or not scores.is_contiguous():
        raise _checks.rows_error(scores, (csr.num_edges, -1), scores.dtype, "edge softmax scores")
    kern = _fn("edge_softmax_fwd", scores.dtype, 1, csr.indices.dtype)
    _go(kern, -(-csr.num_dst // 4), 128, (
        _p(csr.indptr), np.int64(csr.num_dst), np.int32(scores.shape[1]), _p(scores), _p(out)), scores.device)
    return out


def edge_softmax_backward(csr: CSRView, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(E, H) gradient of the scores."""
    out = torch.empty_like(p)
    if csr.num_edges == 0 or csr.num_dst == 0:
        return out
    g = grad.to(p.dtype).contiguous()
    if p.dim() != 2 or p.shape[0] != csr.num_edges or g.shape != p.shape or not p.is_contiguous():
        raise _checks.rows_error(p, (csr.num_edges, -1), p.dtype, "edge softmax probabilities")
    kern = _fn("edge_softmax_bwd", p.dtype, 1, csr.indices.dtype)
    _go(kern, -(-csr.num_dst // 4), 128, (
        _p(csr.indptr), np.int64(csr.num_dst), np.int32(p.shape[1]), _p(p), _p(g), _p(out)), p.device)
    return out
