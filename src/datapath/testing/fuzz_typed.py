"""The fuzz's typed (heterogeneous) groups: the typed ops of `datapath.ops.typed` and the relational layers.

Groups (`TYPED_OPS`): ``typed_linear`` (`typed_linear`, `compact_linear` over concatenated or per-type inputs),
``relations_into`` (`relations_into` / `TypedRelations` checked exactly against the definition, `concat_inputs`,
then an aggregation over the merged CSR: sum/mean/max, edge weights, heads), ``stacked_mean``, the layers
``rgcn`` (no decomposition, basis, block-diagonal), ``rgat`` and ``hgt``, ``add_self_loops`` (its CSR exactly, and
a sum over it) and ``typed_bad_input`` (`datapath.testing.fuzz_typed_errors`).

Typed graphs (`typed_graph`): 1-4 node types (some without nodes), 1-6 relations (self-relations, relations
without edges, duplicate edges, skewed degrees), as a whole `HeteroGraph` (``kind="whole"``), a `HeteroBlock` of
its first rows per type (``"block"``: destination types without destinations, relations into them kept or
dropped) or a block sampled by `HeteroNeighborSampler` (``"sampled"``; on the GPU from a unified or cuda graph).
Every result is compared, forward and every gradient, with `datapath.testing.fuzz_typed_reference` in float64
under `datapath.ops.tolerance`.
"""
from __future__ import annotations

import math
import random
from typing import Any

import torch

from datapath import ops
from datapath.graph import HeteroGraph
from datapath.ops.tolerance import tolerance
from datapath.ops.typed import compact_linear, concat_inputs, relations_into, stacked_mean, typed_linear
from datapath.sampling import HeteroBlock, HeteroNeighborSampler
from datapath.sampling.hetero_block import RelationBlock
from datapath.testing import fuzz_checks as C
from datapath.testing import fuzz_reference as ref
from datapath.testing import fuzz_typed_reference as tref
from datapath.testing.fuzz_checks import DTYPES, Checks, _gen, _half_lib, ratio, tol, values
from datapath.testing.fuzz_graphs import GRAPH_KINDS, edge_lists

TYPED_OPS = ("typed_linear", "relations_into", "stacked_mean", "rgcn", "rgat", "hgt", "add_self_loops",
             "typed_bad_input")
"""The typed groups, in `datapath.testing.fuzz.OPS` order."""
TYPED_WEIGHTS = (3, 4, 3, 5, 5, 5, 2, 3)
KINDS = ("whole", "block", "sampled")
MAX_NODES = {"gpu": 3_000, "cpu": 150}
MAX_EDGES = {"gpu": 30_000, "cpu": 1_500}
TYPED_STAGES = {"rgcn": 4, "rgat": 10, "hgt": 10}
"""Rounding stages one relational layer chains (`datapath.ops.tolerance`'s ``depth``): R-GCN: the per-relation
mean, the stacked matmul, the root matmul, the sum and bias (the basis combination one more); R-GAT: the relation
weights and ``W_r q``, the compact transform, the two score dots and their sum, softmax, the weighted sum, the
head mean, the bias; HGT: the folded weights and their ``p_r / sqrt(D)`` scale, the compact transform, the query,
the score dot, softmax, the weighted sum, GELU, the output linear, the skip."""


def _pick(rng: random.Random, options: Any, weights: Any = None) -> Any:
    return rng.choices(list(options), weights=None if weights is None else list(weights))[0]


def typed_params(rng: random.Random, op: str, p: dict[str, Any], gpu: bool) -> None:
    """Draw the parameters of typed group ``op`` into ``p`` (which holds seed, scale, dtype, edge_budget)."""
    p["kind"] = _pick(rng, KINDS, (35, 35, 30))
    p["width"] = rng.randint(1, 95)
    if op == "typed_linear":
        p["form"] = _pick(rng, ("typed_linear", "compact", "compact_per_type"))
        p["out"] = rng.randint(1, 95)
        p["bias"] = _pick(rng, ("none", "all", "some"))
        p["compact"] = rng.random() < 0.7
    elif op == "relations_into":
        p["compact"] = rng.random() < 0.7
        p["reduce"] = _pick(rng, ("sum", "mean", "max"), (45, 35, 20))
        p["weighted"] = rng.random() < 0.5
        p["heads"] = _pick(rng, (1, 1, 2, 4)) if p["weighted"] else 1
    elif op in ("rgcn", "rgat", "hgt"):
        p["out"] = rng.randint(1, 95)
        p["heads"] = rng.randint(1, 4) if op != "rgcn" else 1
        p["decomp"] = _pick(rng, ("none", "bases", "blocks"), (40, 30, 30)) if op != "hgt" else "none"
        p["bases"] = rng.randint(1, 4)
        p["blocks"] = _pick(rng, (1, 2, 3, 4))
        p["bias"], p["root"] = rng.random() < 0.8, rng.random() < 0.8
        p["concat"] = rng.random() < 0.7
        p["permute"], p["extra"] = rng.random() < 0.5, rng.random() < 0.3
        if op == "hgt":
            p["out"] = p["heads"] * rng.randint(1, max(1, 95 // p["heads"]))
            p["same_width"] = rng.random() < 0.3  # out == in: the skip gate is on
            p["per_type_widths"] = rng.random() < 0.3
    elif op == "add_self_loops":
        p["graph"] = _pick(rng, GRAPH_KINDS)
    elif op == "typed_bad_input":
        from datapath.testing.fuzz_typed_errors import TYPED_SCENARIOS  # noqa: PLC0415

        p["scenario"] = _pick(rng, TYPED_SCENARIOS)
    p["graph_seed"] = rng.getrandbits(40)


# -- graphs ----------------------------------------------------------------------------------------------------
def _count(rng: random.Random, scale: str) -> int:
    if rng.random() < 0.08:
        return 0
    top = math.log2(MAX_NODES[scale])
    return max(1, int(round(2 ** rng.uniform(0 if rng.random() < 0.4 else top / 2, top))))


def typed_graph(params: dict[str, Any], device: Any) -> Any:
    """The case's typed graph (`HeteroGraph` or `HeteroBlock` on ``device``), drawn from ``params["graph_seed"]``."""
    rng = random.Random(params["graph_seed"])
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    scale = params["scale"]
    gpu = torch.device(device).type == "cuda"
    types = [f"t{i}" for i in range(rng.randint(1, 4))]
    counts = {t: _count(rng, scale) for t in types}
    budget = max(8, params["edge_budget"] // max(1, params.get("width", 1) * params.get("heads", 1)))
    nrel = rng.randint(1, 6)
    rels: dict[tuple[str, str, str], torch.Tensor] = {}
    for i in range(nrel):
        s = _pick(rng, types)
        d = s if rng.random() < 0.3 else _pick(rng, types)  # self-relations
        n_s, n_d = counts[s], counts[d]
        e = 0
        if n_s and n_d and rng.random() > 0.15:  # else a relation without edges
            hi = max(1, min(MAX_EDGES[scale], budget // nrel, n_d * _pick(rng, (1, 2, 4, 12, 30))))
            e = rng.randint(max(1, hi // 4) if rng.random() < 0.6 else 1, hi)
        src = (torch.rand(e, generator=gen, dtype=torch.float64) ** rng.uniform(1, 4) * n_s).long().clamp(
            max=max(0, n_s - 1))
        dst = (torch.rand(e, generator=gen, dtype=torch.float64) ** rng.uniform(1, 3) * n_d).long().clamp(
            max=max(0, n_d - 1))
        if e > 1 and rng.random() < 0.3:  # duplicate edges
            k = rng.randint(1, e - 1)
            pick = torch.randint(0, e, (k,), generator=gen)
            src, dst = torch.cat([src, src[pick]]), torch.cat([dst, dst[pick]])
        name = f"r{i}" if rng.random() < 0.8 else "r"  # names may repeat: the triple tells relations apart
        rels[(s, name if (s, name, d) not in rels else f"r{i}", d)] = torch.stack([src, dst])
    hg = HeteroGraph(counts, rels)
    kind = params.get("kind", "whole")
    if kind == "whole":
        return hg.to("cuda") if gpu else hg
    if kind == "sampled" and any(counts.values()):
        seeded = [t for t in types if counts[t]]
        seeds = {t: torch.randperm(counts[t], generator=gen)[: rng.randint(1, min(counts[t], 300))]
                 for t in rng.sample(seeded, rng.randint(1, len(seeded)))}
        fan = [_pick(rng, (-1, 1, 2, 3, 5, 10)) for _ in range(rng.randint(1, 2))]
        g = hg.to(_pick(rng, ("unified", "cuda"))) if gpu else hg
        blocks = HeteroNeighborSampler(fan, replace=rng.random() < 0.2 and -1 not in fan,
                                       seed=rng.getrandbits(31)).sample(
            g, {t: v.to(device) for t, v in seeds.items()})
        return blocks[rng.randrange(len(blocks))]
    # a block of each type's first rows as destinations, every node a source
    n_dst = {t: (0 if rng.random() < 0.25 else rng.randint(0, counts[t])) for t in types}
    blk = {}
    for et, g in hg.relations.items():
        nd = n_dst[et[2]]
        if nd == 0 and rng.random() < 0.5:
            continue  # as the sampler does: no relation into a type without destinations
        ip = g.indptr[: nd + 1].long()
        ix = g.indices[: int(ip[-1])].long()
        hint = int((ip[1:] - ip[:-1]).max()) if nd and rng.random() < 0.5 else None
        blk[et] = RelationBlock(ip.to(device), ix.to(device), counts[et[0]], nd, max_degree=hint)
    return HeteroBlock({t: torch.arange(counts[t], device=device) for t in types}, n_dst, blk)


def _inputs(gen: torch.Generator, e: tref.TypedEdges, widths: dict[str, int], dtype: torch.dtype, device: Any
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``({type: rows on device, requiring grad}, {type: the same in float64 on the CPU, requiring grad})``."""
    xs = {t: values(gen, (n, widths[t]), dtype, "cpu") for t, n in e.num_src.items()}
    pairs = {t: pair(v, device) for t, v in xs.items()}
    return {t: a for t, (a, _) in pairs.items()}, {t: b for t, (_, b) in pairs.items()}


def pair(v: torch.Tensor, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` on ``device`` and in float64 on the CPU: two distinct leaves requiring grad."""
    return v.detach().clone().to(device).requires_grad_(), v.detach().double().clone().requires_grad_()


class _Shape:
    """Row lengths of a typed graph for the tolerances: the longest merged row (``max_in``: every relation's edges
    into one destination) and column (``max_out``: one source node's edges over every relation), and the most
    duplicates of one (relation, source) in a row (``rep_in``) and of one (relation, destination) in a column."""

    def __init__(self, e: tref.TypedEdges) -> None:
        off = e.type_offsets()
        rid = {et: i for i, et in enumerate(e.src)}
        dst_off = {t: o for t, o in zip(e.num_dst, torch.tensor([0, *e.num_dst.values()]).cumsum(0).tolist())}
        d = [e.dst[et] + dst_off[et[2]] for et in e.src]
        s = [e.src[et] + off[et[0]] for et in e.src]
        r = [torch.full_like(e.src[et], rid[et]) for et in e.src]
        z = torch.zeros(0, dtype=torch.int64)
        d, s, r = (torch.cat(v) if v else z for v in (d, s, r))
        self.edges = int(d.numel())
        self.max_in = int(torch.bincount(d).max()) if d.numel() else 0
        self.max_out = int(torch.bincount(s).max()) if s.numel() else 0
        self.rep_in = self.rep_out = 0
        if d.numel():
            ns, nd, nr = int(s.max()) + 1, int(d.max()) + 1, len(rid)
            for a, b, n_a in ((d, s, nd), (s, d, ns)):
                pair, cnt = torch.unique((a * max(ns, nd) + b) * nr + r, return_counts=True)
                dup = cnt > 1
                if bool(dup.any()):
                    most = int(torch.bincount(pair[dup] // (max(ns, nd) * nr), cnt[dup]).max())
                    if a is d:
                        self.rep_in = most
                    else:
                        self.rep_out = most
        self.rows = sum(e.num_src.values()) + sum(e.num_dst.values())


def _grads(out: Checks, name: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], t: Any) -> None:
    for k in want:
        out.append((f"{name}[{k}]", ratio(got[k].grad, want[k].grad, t)))


# -- the typed ops -----------------------------------------------------------------------------------------------
def check_typed_linear(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, k_in, m = DTYPES[params["dtype"]], params["width"], params["out"]
    gen = _gen(params)
    form = params["form"]
    if form == "typed_linear":
        rows = [int(2 ** (10 * float(torch.rand(1, generator=gen)))) - 1 for _ in range(1 + params["graph_seed"] % 4)]
        xs = [values(gen, (n, k_in), dtype, "cpu") for n in rows]
        ins = [k_in] * len(rows)
        w_rows = None
    else:
        g = typed_graph(params, device)
        C.LAST_GRAPH[:] = [id(g)]
        e = tref.TypedEdges.of(g)
        widths = {t: (k_in if form == "compact" else max(1, (k_in + 7 * i) % 96)) for i, t in enumerate(e.num_src)}
        x, x64 = _inputs(gen, e, widths, dtype, device)
        dst_types = [t for t in e.num_dst if e.into(t)] or list(e.num_dst)
        t_dst = dst_types[params["seed"] % len(dst_types)]
        into = relations_into(g, t_dst, compact=params["compact"])
        want_m = tref.merged(e, t_dst, params["compact"])
        out.append(("sources", _exact_list(into.sources, want_m.sources)))
        ins = [widths[et[0]] for et in want_m.edge_types]
        w_rows = want_m
    if not ins:
        return
    bias = params["bias"]
    ws = [values(gen, (i, m), dtype, "cpu") for i in ins]
    bs = [values(gen, (m,), dtype, "cpu") if bias == "all" or (bias == "some" and j % 2 == 0) else None
          for j in range(len(ins))]
    wd, w64 = (list(v) for v in zip(*[pair(w, device) for w in ws]))
    bd, b64 = (list(v) for v in zip(*[pair(b, device) if b is not None else (None, None) for b in bs]))
    if form == "typed_linear":
        if not xs:
            return
        xd, x64l = (list(v) for v in zip(*[pair(v, device) for v in xs]))
        got = typed_linear(xd, wd, bd if bias != "none" else None)
        want = tref.typed_linear(x64l, w64, b64 if bias != "none" else None)
        n_rows = max(rows)
    else:
        x_all = concat_inputs(g, x) if form == "compact" else x
        got = compact_linear(into, x_all, wd, bd if bias != "none" else None)
        parts = [x64[et[0]].index_select(0, src) for et, src in zip(w_rows.edge_types, w_rows.sources)]
        want = tref.typed_linear(parts, w64, b64 if bias != "none" else None)
        n_rows = max(int(src.numel()) for src in w_rows.sources)
    out.append(("forward", ratio(got, want, tolerance(dtype, max(ins)))))
    gy = values(gen, tuple(want.shape), dtype, "cpu")
    got.backward(gy.to(device))
    want.backward(gy.double())
    if form == "typed_linear":
        for j, (a, b) in enumerate(zip(xd, x64l)):
            out.append((f"grad_x{j}", ratio(a.grad, b.grad, tolerance(dtype, m))))
    else:  # a source read by several relations sums their gradients
        _grads(out, "grad_x", x, x64, tolerance(dtype, m * len(ins)))
    for j in range(len(ins)):
        out.append((f"grad_w{j}", ratio(wd[j].grad, w64[j].grad, tol(dtype, wd[j].grad, n_rows))))
        if bd[j] is not None and bias != "none":
            out.append((f"grad_b{j}", ratio(bd[j].grad, b64[j].grad, tol(dtype, bd[j].grad, n_rows))))


def _exact_list(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """0 when the index tensors are equal one by one (values, lengths, count), else inf."""
    if len(got) != len(want):
        return math.inf
    return 0.0 if all(torch.equal(a.cpu().long(), b) for a, b in zip(got, want)) else math.inf


def _rows_of(indptr: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ip, ix = indptr.cpu().long(), indices.cpu().long()
    return torch.repeat_interleave(torch.arange(ip.numel() - 1), ip[1:] - ip[:-1], output_size=ix.numel()), ix


def _same_multiset(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the edges given as aligned columns ``(got_i, want_i)`` are the same multiset of tuples."""
    g = torch.stack([p[0].cpu().long() for p in pairs], 1)
    w = torch.stack([p[1].long() for p in pairs], 1)
    if g.shape != w.shape:
        return False
    if g.numel() == 0:
        return True
    (ug, cg), (uw, cw) = (torch.unique(v, dim=0, return_counts=True) for v in (g, w))
    return torch.equal(ug, uw) and torch.equal(cg, cw)


def check_structure(into: Any, want: tref.Merged, e: tref.TypedEdges, t: str, out: Checks) -> None:
    """`TypedRelations` against the definition, exactly (``inf`` on any difference)."""
    bad = math.inf
    out.append(("edge_types", 0.0 if into.edge_types == want.edge_types else bad))
    out.append(("sources", _exact_list(into.sources, want.sources)))
    out.append(("offsets", 0.0 if list(into.offsets) == want.offsets else bad))
    out.append(("table_rows", _exact_list([into.table_rows], [want.table_rows])))
    out.append(("type_offsets", 0.0 if into.type_offsets == e.type_offsets() else bad))
    n, nr = e.num_dst[t], len(want.edge_types)
    csr = into.csr
    ok = int(csr.num_dst_nodes) == n and int(csr.num_src_nodes) == want.offsets[-1] and \
        csr.indptr.numel() == n + 1 and csr.indices.numel() == want.edge_dst.numel()
    row, col = _rows_of(csr.indptr, csr.indices) if ok else (None, None)
    if ok:  # aligned per-edge arrays, rows listing their edges relation by relation, the right multiset
        rel = into.edge_rel.cpu()
        lo = torch.tensor(want.offsets[:-1])[rel] if rel.numel() else rel
        hi = torch.tensor(want.offsets[1:])[rel] if rel.numel() else rel
        same_row = row[1:] == row[:-1]
        ok = (torch.equal(into.edge_dst.cpu(), row) and bool(((col >= lo) & (col < hi)).all())
              and bool((rel[1:] >= rel[:-1])[same_row].all())
              and _same_multiset((row, want.edge_dst), (rel, want.edge_rel), (col, want.edge_col))
              and torch.equal(into.query_rows.cpu(), row * nr + rel))
    for hint, longest in ((getattr(csr, "max_degree", None), int(torch.bincount(row).max()) if ok and row.numel()
                           else 0),):
        ok = ok and (hint is None or hint >= longest)  # a bound the kernels plan by must hold
    out.append(("merged_csr", 0.0 if ok else bad))
    st = into.stacked
    ok = int(st.num_dst_nodes) == n * nr and st.indptr.numel() == n * nr + 1
    if ok:
        srow, scol = _rows_of(st.indptr, st.indices)
        ok = _same_multiset((srow, want.edge_dst * nr + want.edge_rel), (scol, want.edge_src))
        hint = getattr(st, "max_degree", None)
        ok = ok and (hint is None or not srow.numel() or hint >= int(torch.bincount(srow).max()))
    out.append(("stacked_csr", 0.0 if ok else bad))


def check_relations_into(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width, reduce, heads = DTYPES[params["dtype"]], params["width"], params["reduce"], params["heads"]
    g = typed_graph(params, device)
    C.LAST_GRAPH[:] = [id(g)]
    e = tref.TypedEdges.of(g)
    gen = _gen(params)
    x, _ = _inputs(gen, e, {t: width for t in e.num_src}, dtype, device)
    if any(n for n in e.num_src.values()):
        cat = concat_inputs(g, x)
        want_cat = torch.cat([v.detach().cpu() for v in x.values()])
        out.append(("concat_inputs", 0.0 if torch.equal(cat.detach().cpu(), want_cat) else math.inf))
    for t in e.num_dst:
        into = relations_into(g, t, compact=params["compact"])
        want = tref.merged(e, t, params["compact"])
        check_structure(into, want, e, t, out)
    dst_types = [t for t in e.num_dst if e.into(t) and e.num_dst[t]]
    if not dst_types:
        return
    t = dst_types[params["seed"] % len(dst_types)]
    into = relations_into(g, t, compact=params["compact"])
    want = tref.merged(e, t, params["compact"])
    rows = want.offsets[-1]
    shape = (rows, heads, width) if heads > 1 else (rows, width)
    table = values(gen, shape, dtype, "cpu", distinct=reduce == "max")
    td, t64 = pair(table, device)
    ne = want.edge_dst.numel()
    w = wd = w64 = None
    if params["weighted"]:  # per merged edge, in the merged CSR's order
        w = (torch.rand((ne, heads) if heads > 1 else (ne,), generator=gen, dtype=torch.float64) + 0.25)
        wd = w.to(dtype).to(device).requires_grad_()
        w64 = wd.detach().double().cpu().requires_grad_()
    got = ops.aggregate(into.csr, td, reduce, edge_weight=wd)
    row, col = _rows_of(into.csr.indptr, into.csr.indices)  # checked above to be the definition's multiset
    want_out = ref.aggregate(col, row, e.num_dst[t], t64, reduce, w64)
    sub = tref.TypedEdges({("c", "m", "d"): col}, {("c", "m", "d"): row}, {"c": rows}, {"d": e.num_dst[t]})
    sh = _Shape(sub)
    k = _half_lib(dtype, None, sh.max_in)
    out.append(("forward", ratio(got, want_out, tolerance(dtype, sh.max_in, k, repeats=sh.rep_in))))
    gy = values(gen, tuple(want_out.shape), dtype, "cpu")
    if reduce == "max":
        gy = gy.masked_fill(ref.max_ties(col, row, e.num_dst[t], t64, w64), 0)
    got.backward(gy.to(device))
    if want_out.requires_grad:
        want_out.backward(gy.double())
    kk = _half_lib(dtype, None, sh.max_out)
    out.append(("grad_table", ratio(td.grad, t64.grad, tolerance(dtype, sh.max_out, kk, repeats=sh.rep_out))))
    if wd is not None:
        out.append(("grad_edge_weight", ratio(wd.grad, w64.grad, tol(dtype, wd.grad, width * heads))))


def check_stacked_mean(params: dict[str, Any], device: Any, out: Checks) -> None:
    dtype, width = DTYPES[params["dtype"]], params["width"]
    g = typed_graph(params, device)
    C.LAST_GRAPH[:] = [id(g)]
    e = tref.TypedEdges.of(g)
    gen = _gen(params)
    x, x64 = _inputs(gen, e, {t: width for t in e.num_src}, dtype, device)
    dst_types = [t for t in e.num_dst if e.into(t) and e.num_dst[t]]
    if not dst_types or not any(e.num_src.values()):
        return
    t = dst_types[params["seed"] % len(dst_types)]
    into = relations_into(g, t)
    got = stacked_mean(into, concat_inputs(g, x))
    n = e.num_dst[t]
    want = torch.cat([ref.aggregate(e.src[et], e.dst[et], n, x64[et[0]], "mean") for et in e.into(t)], 1)
    sh = _Shape(e)
    out.append(("forward", ratio(got, want, tolerance(dtype, sh.max_in, _half_lib(dtype, None, sh.max_in),
                                                      repeats=sh.rep_in))))
    gy = values(gen, tuple(want.shape), dtype, "cpu")
    got.backward(gy.to(device))
    want.backward(gy.double())
    _grads(out, "grad_x", x, x64, tolerance(dtype, sh.max_out, _half_lib(dtype, None, sh.max_out),
                                            repeats=sh.rep_out))


def check_add_self_loops(params: dict[str, Any], device: Any, out: Checks) -> None:
    """`datapath.ops.add_self_loops`: every row's edges then ``d -> d``, exactly; a sum over it; its bad input."""
    g, _ = C.graph_of(params, device, params["width"])
    src, dst = edge_lists(g)
    n_src, n_dst = int(g.num_src_nodes), int(g.num_dst_nodes)
    if n_dst > n_src:
        try:
            ops.add_self_loops(g)
        except ops.GraphFormatError as exc:
            out.append(("refused", 0.0 if "num_dst_nodes" in str(exc) else math.inf))
        else:
            out.append(("refused", math.inf))
        return
    lg = ops.add_self_loops(g)
    lsrc, ldst = edge_lists(lg)
    loop = torch.arange(n_dst)
    deg = torch.bincount(dst, minlength=n_dst)
    want_ptr = torch.zeros(n_dst + 1, dtype=torch.int64)
    want_ptr[1:] = (deg + 1).cumsum(0)
    want_src = torch.empty(src.numel() + n_dst, dtype=torch.int64)
    last = want_ptr[1:] - 1
    keep = torch.ones(want_src.numel(), dtype=torch.bool)
    keep[last] = False
    want_src[keep] = src
    want_src[last] = loop
    ok = torch.equal(lg.indptr.cpu().long(), want_ptr) and torch.equal(lsrc, want_src) and \
        int(lg.num_src_nodes) == n_src and int(lg.num_dst_nodes) == n_dst
    out.append(("csr", 0.0 if ok else math.inf))
    dtype, width = DTYPES[params["dtype"]], params["width"]
    x = values(_gen(params), (n_src, width), dtype, "cpu")
    xd, x64 = pair(x, device)
    got = ops.aggregate(lg, xd, "sum")
    want = ref.aggregate(torch.cat([src, loop]), torch.cat([dst, loop]), n_dst, x64, "sum")
    sh = _Shape(tref.TypedEdges({("a", "r", "a"): torch.cat([src, loop])}, {("a", "r", "a"): torch.cat([dst, loop])},
                                {"a": n_src}, {"a": n_dst}))
    out.append(("forward", ratio(got, want, tolerance(dtype, sh.max_in, _half_lib(dtype, None, sh.max_in),
                                                      repeats=sh.rep_in))))
    gy = values(_gen(params, 1), tuple(want.shape), dtype, "cpu")
    got.backward(gy.to(device))
    want.backward(gy.double())
    out.append(("grad_x", ratio(xd.grad, x64.grad, tolerance(dtype, sh.max_out, _half_lib(dtype, None, sh.max_out),
                                                             repeats=sh.rep_out))))
