"""One check per public op and layer for the differential fuzz (`datapath.testing.fuzz`).

Each ``check_<op>(params, device, out)`` builds its inputs from ``params`` (plain values drawn by
`datapath.testing.fuzz.make_case`) and a seeded CPU generator, runs the op on ``device`` forward and
backward, and appends to ``out`` one ``(name, ratio)`` per comparison: the worst element's error over what
`datapath.ops.tolerance` allows it (``> 1`` is a mismatch; ``inf`` a non-finite or misshapen result).
References are `datapath.testing.fuzz_reference` in float64 on the CPU, on the very values the op saw.
"""
from __future__ import annotations

import copy
import gc
import math
import random
from typing import Any

import torch
from torch import nn

from datapath import nn as dnn
from datapath import ops
from datapath.graph import CSRGraph, Graph
from datapath.ops.tolerance import Tolerance, tolerance
from datapath.testing import fuzz_reference as ref
from datapath.testing.fuzz_graphs import edge_lists, fuzz_graph

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
Checks = list  # of (name, ratio)


def ratio(got: torch.Tensor | None, want: torch.Tensor | None, tol: Tolerance,
          mask: torch.Tensor | None = None) -> float:
    """The largest ``|got - want| / (atol * max(1, max |want|) + rtol * |want|)`` (``mask``: positions compared);
    ``inf`` for a misshapen or non-finite ``got``, NaN where ``got`` overflowed because ``want`` itself lies beyond
    the largest value of ``got``'s dtype (no float16 result can be right there: graded as unrepresentable)."""
    if got is None or want is None:  # no gradient: as good as zeros (PyTorch's None for an unused input)
        if got is None and want is None:
            return 0.0
        got = torch.zeros_like(want, device="cpu") if got is None else got
        want = torch.zeros_like(got, device="cpu", dtype=torch.float64) if want is None else want
    g = got.detach().to("cpu", torch.float64)
    r = want.detach().to("cpu", torch.float64)
    if g.shape != r.shape:
        return math.inf
    if mask is not None:
        g, r = g[mask], r[mask]
    if g.numel() == 0:
        return 0.0
    if not torch.isfinite(g).all():  # NaN: the answer itself is beyond the dtype's range (an overflow is right)
        wide = got.dtype.is_floating_point and float(r.abs().max()) > torch.finfo(got.dtype).max
        return math.nan if wide else math.inf
    scale = max(1.0, float(r.abs().max()))
    return float(((g - r).abs() / (tol.atol * scale + tol.rtol * r.abs())).max())


_PRECISION = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def tol(dtype: torch.dtype, got: torch.Tensor | None, row_len: int, kernel: str | None = None,
        depth: int = 1, repeats: int | None = None) -> Tolerance:
    """`datapath.ops.tolerance` for the coarser of the case's dtype and the compared tensor's (a float32 edge
    weight's gradient in a float64 case is rounded to float32)."""
    if got is not None and got.dtype in _PRECISION and _PRECISION.index(got.dtype) < _PRECISION.index(dtype):
        dtype = got.dtype
    return tolerance(dtype, max(0, int(row_len)), kernel, depth=depth, repeats=repeats)


def _gen(params: dict[str, Any], salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(int(params["seed"]) * 7919 + salt)


def values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: Any,
           distinct: bool = False) -> torch.Tensor:
    """Random values of ``dtype`` on ``device`` (drawn on the CPU: the same numbers on any device); ``distinct``:
    every column of a 2-D/3-D tensor holds distinct values (a max then has no ties between sources)."""
    if distinct and shape[0] > 1 and dtype in (torch.float16, torch.bfloat16):
        n, rest = shape[0], math.prod(shape[1:])
        mag = torch.exp2(torch.randint(-7, 5, (8 * n,), generator=gen).double())
        pool = torch.unique(((torch.rand(8 * n, generator=gen, dtype=torch.float64) + 1) * mag).to(dtype))
        pool = torch.cat([pool, -pool])
        if pool.numel() >= n:
            pick = torch.rand(pool.numel(), rest, generator=gen).argsort(0)[:n]
            return pool[pick].reshape(shape).to(device)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def graph_of(params: dict[str, Any], device: Any, width: int = 1) -> tuple[Any, dict[str, Any]]:
    """The case's graph (`fuzz_graph` from ``params["graph_seed"]``)."""
    budget = max(16, params["edge_budget"] // max(1, width))
    g, info = fuzz_graph(random.Random(params["graph_seed"]), params["graph"], device, scale=params["scale"],
                         edge_budget=budget)
    LAST_GRAPH[:] = [id(g), int(g.indptr.data_ptr()), int(g.indices.data_ptr())]
    return g, info


LAST_GRAPH: list[int] = []
"""``[id, indptr address, indices address]`` of the graph the last check made (the fuzz counts reused ones)."""


def fresh(g: Any, clone: bool) -> Any:
    """A new graph object over ``g``'s CSR (``clone``: over copies of its tensors), for a call whose graph dies
    right after the forward -- ``conv(block.to("cuda"), x)`` -- so that what the ops derived from it is freed
    (and its memory handed on) before the backward runs, unless the autograd graph holds it."""
    from datapath.sampling import Block  # noqa: PLC0415 - sampling sits above testing's graphs

    ip, ix = (g.indptr.clone(), g.indices.clone()) if clone else (g.indptr, g.indices)
    if isinstance(g, Block):
        return Block(ip, ix, g.src_nodes.clone() if clone else g.src_nodes, g.num_dst_nodes, trusted=g.trusted,
                     max_degree=g.max_degree)
    if isinstance(g, Graph):
        return Graph(ip, ix, num_src_nodes=g.num_src_nodes, validate=False)
    return CSRGraph(ip, ix, int(g.num_src_nodes), int(g.num_dst_nodes), trusted=bool(getattr(g, "trusted", False)))


class _Edges:
    """The graph's edges on the CPU and the row lengths the tolerances need: the longest row (``max_in``) and
    column (``max_out``), and the most duplicate edges in one row (``rep_in``) and one column (``rep_out``): the
    terms a sum adds again and again (`datapath.ops.tolerance`'s ``repeats``)."""

    def __init__(self, g: Any) -> None:
        self.src, self.dst = edge_lists(g)
        self.num_src, self.num_dst = int(g.num_src_nodes), int(g.num_dst_nodes)
        self.max_in = int(torch.bincount(self.dst).max()) if self.dst.numel() else 0
        self.max_out = int(torch.bincount(self.src).max()) if self.src.numel() else 0
        self.rep_in = self.rep_out = 0
        if self.src.numel():
            pairs, count = torch.unique(self.dst * max(1, self.num_src) + self.src, return_counts=True)
            dup = count > 1
            if bool(dup.any()):
                self.rep_in = int(torch.bincount(pairs[dup] // max(1, self.num_src), count[dup]).max())
                self.rep_out = int(torch.bincount(pairs[dup] % max(1, self.num_src), count[dup]).max())


def _half_lib(dtype: torch.dtype, kernel: str | None, row_len: int) -> str | None:
    """The kernel whose tolerance applies: the default plan may pick cuSPARSE for 16-bit rows of <= 16 edges."""
    if kernel is None and dtype in (torch.float16, torch.bfloat16) and row_len <= 16:
        return "cusparse"
    return kernel


def _plan(params: dict[str, Any], g: Any, width: int, dtype: torch.dtype, reduce: str, norm: str | None,
          weighted: bool) -> tuple[Any, str | None]:
    """``(plan for aggregate(plan=...), kernel for the tolerance)`` from the case's ``mode``."""
    mode = params.get("mode", "default")
    if mode.startswith("plan:"):
        kernel = mode[5:]
        extra = dict(params.get("plan_extra", {}))
        if extra.get("vec") and width % extra["vec"]:
            extra.pop("vec")
            extra.pop("dw", None)
        return ops.plan_aggregation(g, width, dtype, kernel=kernel, **extra), kernel
    if mode.startswith("probe:"):
        kernel = mode[6:]
        ops.plan_aggregation(g, width, dtype, reduce if reduce != "max" else "sum", probe=True, kernels=(kernel,),
                             edge_weight=weighted, norm=norm)
        return None, kernel
    return None, None


def check_aggregate(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width, reduce = DTYPES[params["dtype"]], params["width"], params["reduce"]
    norm = "gcn" if params.get("norm") and reduce == "sum" else None
    heads = params.get("heads", 1)
    g, _ = graph_of(params, device, width * heads)
    e = _Edges(g)
    gen = _gen(params)
    shape = (e.num_src, heads, width) if heads > 1 else (e.num_src, width)
    x = values(gen, shape, dtype, device, distinct=reduce == "max").clone()
    if params.get("noncontig") and x.dim() == 2 and x.shape[0] > 1:  # the same values, every other row of a buffer
        x = torch.stack([x, torch.zeros_like(x)], 1).reshape(2 * x.shape[0], -1)[::2]
    x.requires_grad_(params.get("grad_x", True))
    w = None
    if params.get("weighted"):
        wshape = (e.src.numel(), heads) if heads > 1 else (e.src.numel(),)
        w = (torch.rand(wshape, generator=gen, dtype=torch.float64) + 0.25).to(dtype if params.get("w_same") else
                                                                             torch.float32).to(device)
        w.requires_grad_(params.get("grad_w", True))
    plan, kernel = _plan(params, g, width * heads, dtype, reduce, norm, w is not None)
    if params.get("prepare") and heads == 1 and w is None:  # what a loader thread builds ahead of the step
        ops.prepare_aggregation(g, width, dtype, backward=True, plan=plan, reduce=reduce, norm=norm)
    if params.get("temp_graph") and plan is None and not params.get("mode", "").startswith("probe"):
        got = ops.aggregate(fresh(g, params["temp_graph"] == "clone"), x, reduce, edge_weight=w, norm=norm)
        gc.collect()
    else:
        got = ops.aggregate(g, x, reduce, edge_weight=w, norm=norm, plan=plan)
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_() if w is not None else None
    want = ref.aggregate(e.src, e.dst, e.num_dst, x64, reduce, w64, norm)
    out.append(("forward", ratio(got, want, tolerance(dtype, e.max_in, _half_lib(dtype, kernel, e.max_in),
                                                      repeats=e.rep_in))))
    if got.requires_grad:
        gy = values(gen, tuple(got.shape), dtype, "cpu")
        if reduce == "max":  # ties: the gradient may go to either; compare only where the max is unique
            gy = gy.masked_fill(ref.max_ties(e.src, e.dst, e.num_dst, x64, w64), 0)
        got.backward(gy.to(device))
        if want.requires_grad:  # else nothing reached the inputs (no edges): their gradients must be zero
            want.backward(gy.double())
        if x.requires_grad:
            k = _half_lib(dtype, kernel, e.max_out)
            out.append(("grad_x", ratio(x.grad, x64.grad, tolerance(dtype, e.max_out, k, repeats=e.rep_out))))
        if w is not None and w.requires_grad:
            out.append(("grad_w", ratio(w.grad, w64.grad, tol(dtype, w.grad, width * heads, kernel))))


def table_for(rows: torch.Tensor, placement: str, device: Any) -> torch.Tensor:
    """``rows`` (CPU) as a feature table in ``placement``: cuda, unified (``to("unified")``), as_unified
    (pinned in place), pinned (``pin_memory()``) or cpu."""
    from datapath.unified_tensor import as_unified  # noqa: PLC0415 - unified_tensor sits above testing

    if placement == "cuda":
        return rows.to(device)
    if placement == "unified":
        return rows.to("unified")
    if placement == "as_unified":
        return as_unified(rows.clone())
    if placement == "pinned":
        return rows.pin_memory()
    return rows


def check_aggregate_fused(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width, reduce = DTYPES[params["dtype"]], params["width"], params["reduce"]
    norm = "gcn" if params.get("norm") and reduce == "sum" else None
    g, _ = graph_of(params, device, width)
    e = _Edges(g)
    gen = _gen(params)
    n_rows = e.num_src + params.get("extra_rows", 0)
    rows = values(gen, (max(1, n_rows), width), dtype, "cpu", distinct=reduce == "max")
    ids = torch.randperm(max(1, n_rows), generator=gen)[: e.num_src]
    if ids.numel() < e.num_src:
        ids = torch.zeros(e.num_src, dtype=torch.int64)
    ids = ids.to(torch.int32 if params.get("ids32") else torch.int64)
    table = table_for(rows, params["table"], device)
    w = None
    if params.get("weighted"):
        w = (torch.rand(e.src.numel(), generator=gen, dtype=torch.float64) + 0.25).float().to(device)
        w.requires_grad_(params.get("grad_w", True))
    plan = None
    if params.get("fused") in ("push", "pull"):
        plan = ops.plan_aggregation(g, width, dtype, fused=params["fused"])
    got = ops.aggregate(g, table, reduce, edge_weight=w, norm=norm, src_ids=ids.to(device), plan=plan)
    x64 = rows.double()[ids.long()]
    w64 = w.detach().double().cpu().requires_grad_() if w is not None else None
    want = ref.aggregate(e.src, e.dst, e.num_dst, x64, reduce, w64, norm)
    out.append(("forward", ratio(got, want, tolerance(dtype, e.max_in, repeats=e.rep_in))))
    if w is not None and w.requires_grad and got.requires_grad:
        gy = values(gen, tuple(got.shape), dtype, "cpu")
        if reduce == "max":
            gy = gy.masked_fill(ref.max_ties(e.src, e.dst, e.num_dst, x64, w64), 0)
        got.backward(gy.to(device))
        if want.requires_grad:  # else nothing reached the inputs (no edges): their gradients must be zero
            want.backward(gy.double())
        out.append(("grad_w", ratio(w.grad, w64.grad, tol(dtype, w.grad, width))))


def check_aggregate_transposed(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width = DTYPES[params["dtype"]], params["width"]
    reduce = "mean" if params["reduce"] == "mean" else "sum"
    norm = "gcn" if params.get("norm") and reduce == "sum" else None
    g, _ = graph_of(params, device, width)
    e = _Edges(g)
    y = values(_gen(params), (e.num_dst, width), dtype, device)
    if params.get("resolved"):
        got = ops.transposed_aggregator(g, width, dtype, reduce, norm)(y)
    else:
        got = ops.aggregate_transposed(g, y, reduce, norm)
    x64 = torch.zeros(e.num_src, width, dtype=torch.float64, requires_grad=True)
    ref.aggregate(e.src, e.dst, e.num_dst, x64, reduce, None, norm).backward(y.double().cpu())
    out.append(("forward", ratio(got, x64.grad, tolerance(dtype, e.max_out, _half_lib(dtype, None, e.max_out),
                                                          repeats=e.rep_out))))


def check_sddmm(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width, op = DTYPES[params["dtype"]], params["width"], params["op"]
    heads = params.get("heads", 1)
    g, _ = graph_of(params, device, width * heads)
    e = _Edges(g)
    gen = _gen(params)
    tail = (heads, width) if heads > 1 else (width,)
    a = values(gen, (e.num_dst, *tail), dtype, device).clone().requires_grad_()
    b = values(gen, (e.num_src, *tail), dtype, device).clone().requires_grad_()
    got = ops.sddmm(g, a, b, op)
    a64, b64 = (t.detach().double().cpu().requires_grad_() for t in (a, b))
    want = ref.sddmm(e.src, e.dst, a64, b64, op)
    out.append(("forward", ratio(got, want, tolerance(dtype, width))))
    gy = values(gen, tuple(got.shape), dtype, "cpu")
    got.backward(gy.to(device))
    want.backward(gy.double())
    out.append(("grad_a", ratio(a.grad, a64.grad, tolerance(dtype, e.max_in * width, repeats=e.rep_in * width))))
    out.append(("grad_b", ratio(b.grad, b64.grad, tolerance(dtype, e.max_out * width, repeats=e.rep_out * width))))


def check_edge_softmax(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, heads = DTYPES[params["dtype"]], params.get("heads", 1)
    g, _ = graph_of(params, device, heads)
    e = _Edges(g)
    gen = _gen(params)
    shape = (e.src.numel(), heads) if params.get("two_d") or heads > 1 else (e.src.numel(),)
    s = (values(gen, shape, dtype, "cpu").double() * params.get("spread", 1.0)).to(dtype).to(device).requires_grad_()
    got = ops.edge_softmax(g, s)
    s64 = s.detach().double().cpu().requires_grad_()
    want = ref.edge_softmax(e.dst, e.num_dst, s64)
    out.append(("forward", ratio(got, want, tolerance(dtype, e.max_in, repeats=e.rep_in))))
    gy = values(gen, tuple(got.shape), dtype, "cpu")
    got.backward(gy.to(device))
    want.backward(gy.double())
    out.append(("grad_scores", ratio(s.grad, s64.grad, tolerance(dtype, e.max_in, repeats=e.rep_in))))


def _layer(params: dict[str, Any]) -> nn.Module:
    torch.manual_seed(int(params["seed"]))
    op, i, o = params["op"], params["in"], params["out"]
    if op == "sage":
        return dnn.SAGEConv(i, o, aggr=params["aggr"], bias=params.get("bias", True),
                            root_weight=params.get("root", True), normalize=params.get("normalize", False))
    if op == "gcn":
        return dnn.GCNConv(i, o, normalize=params.get("normalize", True), add_self_loops=params.get("loops", False),
                           bias=params.get("bias", True))
    if op == "gin":
        mlp = nn.Linear(i, o) if not params.get("mlp") else nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))
        conv = dnn.GINConv(mlp, eps=params.get("eps", 0.0), train_eps=params.get("train_eps", False),
                           aggr=params["aggr"])
        return conv
    if op == "gat":
        ins = (i, params["in_dst"]) if params.get("bipartite_lin") else i
        return dnn.GATConv(ins, o, heads=params.get("heads", 1), concat=params.get("concat", True),
                           bias=params.get("bias", True))
    kind = "gcn" if op == "full_gcn" else "gin"
    return dnn.build_full_graph_model(kind, i, o, hidden_channels=params["hidden"], num_layers=params["layers"],
                                      dropout=0.5)


LAYER_STAGES = {"sage": 4, "gcn": 4, "gin": 4, "gat": 8, "full_gcn": 4, "full_gin": 4}
"""Rounding stages one layer chains, `datapath.ops.tolerance`'s ``depth`` (projection, aggregation, root term,
bias; GAT: projection, attention dots, edge scores, softmax, weighted aggregation, head mean)."""


def stages(params: dict[str, Any]) -> int:
    """The rounding stages behind a layer case's outputs and gradients (`LAYER_STAGES` per layer, plus the
    normalization and a second Linear, times the layers of a full-graph model)."""
    n = LAYER_STAGES[params["op"]] + int(bool(params.get("normalize")) and params["op"] == "sage") + \
        int(bool(params.get("mlp"))) * 2
    return n * max(1, params.get("layers", 1))


def check_layer(params: dict[str, Any], device: Any, out: Checks) -> None:
    """SAGEConv / GCNConv / GINConv / GATConv / the full-graph GCN and GIN against their float64 definitions."""
    op, dtype = params["op"], DTYPES[params["dtype"]]
    conv = _layer(params)
    g, _ = graph_of(params, device, params["in"] + params["out"])
    e = _Edges(g)
    gen = _gen(params)
    form = params.get("form", "x")
    if e.num_dst > e.num_src and form == "x":
        form = "pair"
    if op in ("full_gcn", "full_gin"):
        form = "x"
    maxed = params.get("aggr") == "max"
    x = values(gen, (e.num_src, params["in"]), dtype, "cpu", distinct=maxed)
    in_dst = params.get("in_dst", params["in"]) if op == "gat" and params.get("bipartite_lin") else params["in"]
    x_dst = values(gen, (e.num_dst, in_dst), dtype, "cpu", distinct=maxed) if form == "pair" else None
    if op == "gat" and params.get("bipartite_lin") and form != "pair":
        form, x_dst = "pair", values(gen, (e.num_dst, in_dst), dtype, "cpu")
    w = None
    if params.get("weighted") and op in ("sage", "gcn", "gin") and not (op == "gcn" and params.get("loops")):
        w = (torch.rand(e.src.numel(), generator=gen, dtype=torch.float64) + 0.25).float().to(device)
        w.requires_grad_()
    conv = conv.to(device, dtype)
    if op in ("full_gcn", "full_gin"):
        conv.eval()
    ref_conv = copy.deepcopy(conv).to("cpu", torch.float64)
    xd = x.clone().to(device).requires_grad_()
    x64 = x.double().clone().requires_grad_()
    xd_dst = x_dst.clone().to(device).requires_grad_() if x_dst is not None else None
    x64_dst = x_dst.double().clone().requires_grad_() if x_dst is not None else None
    w64 = w.detach().double().cpu().requires_grad_() if w is not None else None
    kw = {} if op in ("gat", "full_gcn", "full_gin") else {"edge_weight": w}
    x_ref = x64
    if form == "fused":  # a table read through src_ids (a random permutation of its rows); it gets no gradient
        ids = torch.randperm(e.num_src, generator=gen) if e.num_src else torch.zeros(0, dtype=torch.int64)
        table = table_for(x, params.get("table", "cuda"), device)
        got = conv(g, table, src_ids=ids.to(device), **kw)
        xd, x_ref = None, x.double()[ids]
    elif form == "pair":
        got = conv(g, (xd, xd_dst), **kw)
    elif params.get("temp_graph"):  # the graph object (and, cloned, its tensors) dies after the forward
        got = conv(fresh(g, params["temp_graph"] == "clone"), xd, **kw)
        gc.collect()
    else:
        got = conv(g, xd, **kw)
    src, dst = e.src, e.dst
    xr_dst = x64_dst if form == "pair" else x_ref[: e.num_dst]
    if op == "sage":
        want = ref.sage(src, dst, e.num_dst, x_ref, xr_dst, ref_conv, w64)
    elif op == "gcn":
        want = ref.gcn(src, dst, e.num_dst, e.num_src, x_ref, ref_conv, w64)
    elif op == "gin":
        want = ref.gin(src, dst, e.num_dst, x_ref, xr_dst, ref_conv, w64)
    elif op == "gat":
        want = ref.gat(src, dst, e.num_dst, x_ref, xr_dst, ref_conv, form == "pair")
    else:
        want = ref.full_graph(src, dst, e.num_dst, x_ref, ref_conv)
    depth = params.get("layers", 1)
    row = e.max_in + e.max_out + params["in"] + params["out"] + params.get("hidden", 0) + e.num_src
    reps = (e.rep_in + e.rep_out) * depth  # duplicate edges' terms, in the forward's rows and the backward's columns
    half = dtype in (torch.float16, torch.bfloat16)
    if op == "gat" and half:  # GAT rounds every per-edge term of its attention path (scores, softmax, their
        # gradients, the head dots' products) to the layer's dtype before a float32 sum: "operand" sums over a
        # row's or a column's edges and the head's channels (its matmuls sum exact products in float32)
        t = tolerance(dtype, (e.max_in + e.max_out + params["out"]) * depth, "operand", depth=stages(params),
                      repeats=reps)
    else:
        t = tolerance(dtype, row * depth, _half_lib(dtype, None, e.max_in + e.max_out), depth=stages(params),
                      repeats=reps)
    out.append(("forward", ratio(got, want, t)))
    if not got.requires_grad:
        return
    gy = values(gen, tuple(got.shape), dtype, "cpu")
    if op == "gat":  # a score at leaky_relu's kink: its gradient may take either slope (see `ref.gat_kinks`)
        kinks = ref.gat_kinks(src, dst, e.num_dst, x_ref, xr_dst, ref_conv, form == "pair",
                              torch.finfo(dtype).eps / 2)
        gy = gy.masked_fill(kinks.reshape(-1, *([1] * (gy.dim() - 1))), 0)
    got.backward(gy.to(device))
    want.backward(gy.double())
    if xd is not None:
        out.append(("grad_x", ratio(xd.grad, x64.grad, t)))
    if xd_dst is not None:
        out.append(("grad_x_dst", ratio(xd_dst.grad, x64_dst.grad, t)))
    if w is not None:
        out.append(("grad_edge_weight", ratio(w.grad, w64.grad, tol(dtype, w.grad, row * depth, depth=stages(params),
                                                                    repeats=reps))))
    theirs = dict(ref_conv.named_parameters())
    for name, p in conv.named_parameters():
        tp = t
        if p.numel() == 1 or name.startswith("att_"):  # GIN's eps, GAT's attention vectors: broadcast factors,
            # whose gradient sums a product per row and column, each rounded to the layer's dtype: "operand" sums
            wide = max(params["in"], params["out"], params.get("hidden", 0))
            tp = tolerance(dtype, (row + (e.num_src + e.num_dst) * wide) * depth, "operand" if half else None,
                           depth=stages(params), repeats=reps)
        out.append((f"grad_{name}", ratio(p.grad, theirs[name].grad, tp)))

