"""B3: GNN aggregation kernels vs cuSPARSE (forward, forward+backward, every dtype), the PyG way, PyG layers;
fixed cost per call; node reordering; the fused host path.

Parts:
  spmm      sum aggregation on graphs shaped like GNNAdvisor's Type I/II/III datasets (community graphs,
            random node order, `datapath.testing.graphs.seed_graph`) at widths 16, 64, 128, 602 in float32,
            bfloat16 and float16.  Each graph's plan is probed once (`plan_aggregation(probe=True)`,
            forward and backward), then timed against:
              cusparse        torch.sparse.mm with a CSR matrix, autograd as a user writes it
              cusparse_pret   torch.sparse.mm forward, backward with a prebuilt transposed CSR (the bar)
              index_add       x.index_select + index_add_ (the PyG way; float32 only)
            and the largest error of datapath's and cuSPARSE's output, relative to the largest output of
            cuSPARSE in float64 (``*_max_err``: cuSPARSE accumulates float16/bfloat16 in that precision,
            datapath in float32, so on long rows their accuracy differs, and the plan keeps cuSPARSE for
            half precision only on graphs of short rows).
            With --candidates every kernel is also timed on its own (forward, and over the transpose).
  fixed     the cost of one call on a small graph (citeseer shape, F=16): CUDA-event time of a single
            call and host microseconds per call, datapath vs torch.sparse.mm.
  reorder   `datapath.graph.reorder` (rcm, degree, community): the planned forward time and the tensor-core
            tiles' density before and after, on three graphs.
  layers    PyG SAGEConv / GCNConv / GINConv vs datapath.nn with the same weights, forward+backward.
  fused     first layer of a GraphSAGE batch (fanouts 15/10/5, batch 1024) on products (2.4M x 100) and
            reddit (233K x 602) shaped float32 tables in pinned host memory: gather (datapath unified
            gather) then aggregate vs the fused aggregation (push and pull), each on a new block per call
            ("cold") and on a block whose schedules the loader prepared ("prepared").

Run:  PYTHONPATH=src:. python benchmarks/aggregate.py [--quick] [--candidates] [--parts spmm,fixed,...]
Writes benchmarks/results/aggregate.json and aggregate.png; prints the summary table last.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, cuda_time_ms, interleaved_ms, print_table, write_result
from datapath import memory
from datapath.graph import CSRGraph
from datapath.ops import KERNELS, aggregate, plan_aggregation, prepare_aggregation
from datapath.testing import edge_index, seed_graph

GRAPHS = ("citeseer", "ppi", "OVCAR-8H", "amazon0505", "artist", "soc-BlogCatalog")
WIDTHS = (16, 64, 128, 602)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARTS = ("spmm", "fixed", "reorder", "layers", "fused")


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


class _PretransposedSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.at = at
        return torch.sparse.mm(a, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return torch.sparse.mm(ctx.at, g), None, None


def csr_tensors(g: CSRGraph, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, A^T) as torch sparse CSR tensors (cuSPARSE), values one, in ``dtype``."""
    e = g.indices.numel()
    a = torch.sparse_csr_tensor(g.indptr.to(torch.int32), g.indices.to(torch.int32),
                                torch.ones(e, device="cuda", dtype=dtype), (g.num_dst_nodes, g.num_src_nodes))
    at = a.to(torch.float32).t().to_sparse_csr()
    at = torch.sparse_csr_tensor(at.crow_indices().to(torch.int32), at.col_indices().to(torch.int32),
                                 at.values().to(dtype), (g.num_src_nodes, g.num_dst_nodes))
    return a, at


def time_ways(ways: dict[str, Any], x: torch.Tensor, gy: torch.Tensor, reps: int) -> dict[str, tuple[float, float]]:
    """{way: (forward ms without autograd, forward+backward ms)} of ``way(x)``, ways interleaved."""
    def fwd(fn: Any) -> Any:
        def call() -> None:
            with torch.no_grad():
                fn(x)
        return call

    def step(fn: Any) -> Any:
        def call() -> None:
            x.grad = None
            fn(x).backward(gy)
        return call

    t_f = interleaved_ms({w: fwd(fn) for w, fn in ways.items()}, reps)
    t_fb = interleaved_ms({w: step(fn) for w, fn in ways.items()}, reps)
    return {w: (t_f[w], t_fb[w]) for w in ways}


def candidate_times(g: CSRGraph, x: torch.Tensor, repeat: int) -> dict[str, float]:
    """Forward ms of every kernel forced by a plan (``T:`` prefix: over the transposed CSR, i.e. backward)."""
    out: dict[str, float] = {}
    f, dt = x.shape[1], x.dtype
    gy = torch.randn(g.num_dst_nodes, f, device="cuda").to(dt)
    for k in KERNELS:
        for cut in ((128, 512) if k == "rows" else (128,)):
            name = k if k != "rows" else f"rows/{cut}"
            p = plan_aggregation(g, f, dt, kernel=k, cut=cut)
            try:
                with torch.no_grad():
                    out[name] = cuda_time_ms(lambda: aggregate(g, x, plan=p), warmup=1, repeat=repeat)
                xr = x.detach().requires_grad_()
                y = aggregate(g, xr, plan=p)
                out["T:" + name] = cuda_time_ms(lambda: torch.autograd.grad(y, xr, gy, retain_graph=True),
                                                warmup=1, repeat=repeat)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                out[name] = float("nan")
                print(f"    {name}: {str(exc).splitlines()[0][:100]}")
    return out


def bench_spmm(graphs: dict[str, CSRGraph], widths: tuple[int, ...], dtypes: dict[str, torch.dtype], repeat: int,
               rows: list[dict], candidates: bool, checkpoint: Any) -> None:
    for name, g in graphs.items():
        e = g.indices.numel()
        src, dst = edge_index(g)
        a64 = csr_tensors(g, torch.float64)[0]  # the accuracy reference: cuSPARSE in float64
        for dname, dt in dtypes.items():
            a, at = csr_tensors(g, dt)
            for f in widths:
                x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt).requires_grad_()
                gy = torch.randn(g.num_dst_nodes, f, device="cuda").to(dt)
                t0 = time.perf_counter()
                plan = plan_aggregation(g, f, dt, probe=True)
                t_probe = (time.perf_counter() - t0) * 1e3
                ways = {
                    "datapath": lambda x: aggregate(g, x),
                    "cusparse": lambda x: torch.sparse.mm(a, x),
                    "cusparse_pret": lambda x: _PretransposedSpMM.apply(x, a, at),
                }
                if dt == torch.float32:
                    ways["index_add"] = lambda x: torch.zeros(g.num_dst_nodes, x.shape[1], device="cuda").index_add_(
                        0, dst, x.index_select(0, src))
                res = time_ways(ways, x, gy, repeat)
                with torch.no_grad():  # max error relative to max |out| of float64, ours and cuSPARSE's in this dtype
                    ref = torch.sparse.mm(a64, x.detach().double())
                    scale = float(ref.abs().max().clamp(min=1e-30))
                    errs = {w: float((fn(x.detach()).double() - ref).abs().max()) / scale
                            for w, fn in (("datapath", ways["datapath"]), ("cusparse", ways["cusparse"]))}
                    del ref
                from datapath.ops import as_csr  # noqa: PLC0415 - the backward's plan, for the record

                key = ("plan", f, dt, "sum", False, 1)
                bwd = as_csr(g).transposed().cache.get(key)
                probed = {"fwd": as_csr(g).cache.get(("probe_ms", *key)),
                          "bwd": as_csr(g).transposed().cache.get(("probe_ms", *key))}
                row = {"device": torch.cuda.get_device_name(), "graph": name, "nodes": g.num_dst_nodes, "edges": e,
                       "F": f, "dtype": dname,
                       "kernel_fwd": plan.kernel, "kernel_bwd": bwd.kernel if bwd is not None else None,
                       "plan": str(plan), "probe_ms": t_probe, "probe_candidates_ms": probed,
                       **{f"{w}_fwd_ms": v[0] for w, v in res.items()},
                       **{f"{w}_fb_ms": v[1] for w, v in res.items()},
                       **{f"{w}_max_err": v for w, v in errs.items()}}
                row["speedup_fwd_vs_cusparse"] = row["cusparse_fwd_ms"] / row["datapath_fwd_ms"]
                row["speedup_fb_vs_cusparse_pret"] = row["cusparse_pret_fb_ms"] / row["datapath_fb_ms"]
                row["speedup_fb_vs_cusparse_autograd"] = row["cusparse_fb_ms"] / row["datapath_fb_ms"]
                if candidates:
                    row["candidates_ms"] = candidate_times(g, x.detach(), max(2, repeat // 2))
                rows.append(row)
                print(f"  {name:>15} {dname:>8} F={f:<4} {plan.kernel:>11}/{row['kernel_bwd']}: fwd "
                      f"{row['datapath_fwd_ms']:.3f} ms (cuSPARSE {row['cusparse_fwd_ms']:.3f}), fwd+bwd "
                      f"{row['datapath_fb_ms']:.3f} (pret {row['cusparse_pret_fb_ms']:.3f})"
                      + (f"  cands {({k: round(v, 3) for k, v in row['candidates_ms'].items()})}" if candidates else ""),
                      flush=True)
                del x, gy
            torch.cuda.empty_cache()
        checkpoint()


def bench_fixed(repeat: int = 300) -> dict:
    """Fixed cost of one call on the citeseer-shaped graph at F=16 (float32, no autograd)."""
    g, _ = seed_graph("citeseer", device="cuda")
    x = torch.randn(g.num_src_nodes, 16, device="cuda")
    a, _ = csr_tensors(g, torch.float32)
    ways = {"datapath": lambda: aggregate(g, x), "datapath_mean": lambda: aggregate(g, x, "mean"),
            "cusparse": lambda: torch.sparse.mm(a, x)}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    with torch.no_grad():
        for w, fn in ways.items():
            out[f"{w}_event_ms"] = cuda_time_ms(fn, warmup=20, repeat=50)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            torch.cuda.synchronize()
            out[f"{w}_host_us"] = (time.perf_counter() - t0) / repeat * 1e6
    out["ratio_event_vs_cusparse"] = out["datapath_event_ms"] / out["cusparse_event_ms"]
    out["ratio_host_vs_cusparse"] = out["datapath_host_us"] / out["cusparse_host_us"]
    print("  fixed cost: " + ", ".join(f"{k}={v:.4g}" for k, v in out.items() if k != "device"), flush=True)
    return out


def bench_reorder(graphs: dict[str, CSRGraph], repeat: int) -> list[dict]:
    from datapath.graph import reorder, window_locality  # noqa: PLC0415

    rows = []
    for name in ("amazon0505", "soc-BlogCatalog", "artist"):
        if name not in graphs:
            continue
        g0 = graphs[name]
        for method in ("none", "rcm", "degree", "community"):
            t0 = time.perf_counter()
            g = g0 if method == "none" else reorder(g0, method)[0]
            t_reorder = time.perf_counter() - t0
            rec = {"device": torch.cuda.get_device_name(), "graph": name, "method": method, "reorder_s": t_reorder,
                   "unique_nbrs_per_window": window_locality(g)}
            for dname, dt, f in (("float32", torch.float32, 64), ("bfloat16", torch.bfloat16, 64)):
                x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt)
                plan = plan_aggregation(g, f, dt, probe=True)
                with torch.no_grad():
                    rec[f"{dname}_fwd_ms"] = cuda_time_ms(lambda: aggregate(g, x), warmup=2, repeat=repeat)
                rec[f"{dname}_kernel"] = plan.kernel
                p_tc = plan_aggregation(g, f, dt, kernel="tensor_core") if dt != torch.float32 else None
                if p_tc is not None:
                    with torch.no_grad():
                        rec[f"{dname}_tc_fwd_ms"] = cuda_time_ms(lambda: aggregate(g, x, plan=p_tc), warmup=2,
                                                                 repeat=repeat)
            rows.append(rec)
            print(f"  reorder {name} {method}: {rec}", flush=True)
    return rows


def bench_layers(graphs: dict[str, CSRGraph], repeat: int, fin: int = 128, fout: int = 64) -> list[dict]:
    try:
        import torch_geometric.nn as pyg  # noqa: PLC0415
    except ImportError:
        print("  PyG not importable: layer comparison skipped")
        return []
    from datapath.nn import GCNConv, GINConv, SAGEConv  # noqa: PLC0415

    rows = []
    for name, g in graphs.items():
        ei = edge_index(g)
        x = torch.randn(g.num_src_nodes, fin, device="cuda", requires_grad=True)
        gy = torch.randn(g.num_dst_nodes, fout, device="cuda")
        for kind, ours, theirs in (
            ("SAGEConv", SAGEConv(fin, fout), pyg.SAGEConv(fin, fout)),
            ("GCNConv", GCNConv(fin, fout), pyg.GCNConv(fin, fout, add_self_loops=False, cached=True)),
            ("GINConv", GINConv(torch.nn.Linear(fin, fout)), pyg.GINConv(torch.nn.Linear(fin, fout))),
        ):
            theirs = theirs.cuda()
            ours = ours.cuda()
            ours.load_state_dict(theirs.state_dict(), strict=False)
            with torch.no_grad():
                err = float((ours(g, x) - theirs(x, ei)).abs().max())
            res = time_ways({"datapath": lambda x: ours(g, x), "pyg": lambda x: theirs(x, ei)}, x, gy,
                            repeat)
            t_ours, t_pyg = res["datapath"], res["pyg"]
            rows.append({"device": torch.cuda.get_device_name(), "graph": name, "layer": kind, "in": fin, "out": fout, "max_abs_diff": err,
                         "datapath_fwd_ms": t_ours[0], "datapath_fb_ms": t_ours[1], "pyg_fwd_ms": t_pyg[0],
                         "pyg_fb_ms": t_pyg[1], "speedup_fwd": t_pyg[0] / t_ours[0],
                         "speedup_fb": t_pyg[1] / t_ours[1]})
            print(f"  layer {name} {kind}: fb {t_ours[1]:.3f} ms vs PyG {t_pyg[1]:.3f} (diff {err:.2g})", flush=True)
    return rows


def first_layer_block(num_nodes: int, batch: int, fanouts: tuple[int, ...], seed: int,
                      skew: float = 0.8) -> tuple[CSRGraph, torch.Tensor]:
    """A synthetic first-layer block of a GraphSAGE batch: (block CSR, src_ids into the table).

    Seeds expand by the fanouts (innermost last); the first layer's destinations are the nodes
    reached after all but the first-layer hop; each gets ``fanouts[0]`` neighbours drawn from a
    power-law popularity over the whole graph (hubs recur, as on ogbn-products).
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pop = torch.arange(1, num_nodes + 1, device="cuda", dtype=torch.float32).pow(-skew)
    perm = torch.randperm(num_nodes, device="cuda", generator=gen)
    nodes = perm[torch.randperm(num_nodes, device="cuda", generator=gen)[:batch]]
    for fan in reversed(fanouts[1:]):
        nb = perm[torch.multinomial(pop, nodes.numel() * fan, replacement=True, generator=gen)]
        nodes = torch.unique(torch.cat([nodes, nb]))
    dst_nodes = nodes[torch.randperm(nodes.numel(), device="cuda", generator=gen)]
    nd, fan = dst_nodes.numel(), fanouts[0]
    nbrs = perm[torch.multinomial(pop, nd * fan, replacement=True, generator=gen)]
    allv = torch.cat([dst_nodes, nbrs])
    uniq, inv = torch.unique(allv, return_inverse=True)
    first = torch.full((uniq.numel(),), allv.numel(), device="cuda", dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(allv.numel(), device="cuda"), "amin")
    order = torch.argsort(first)
    local = torch.empty_like(order)
    local[order] = torch.arange(order.numel(), device="cuda")
    indices = local[inv[nd:]].to(torch.int32)
    indptr = torch.arange(0, nd * fan + 1, fan, device="cuda", dtype=torch.int64)
    return CSRGraph(indptr, indices, uniq.numel(), nd, trusted=True), uniq[order]


def bench_fused(shape: str, num_nodes: int, feat: int, batch: int, fanouts: tuple[int, ...], repeat: int,
                skew: float) -> dict:
    """Gather-then-aggregate vs fused aggregation of the first layer, the table in pinned host memory."""
    t0 = time.perf_counter()
    table = torch.empty(num_nodes, feat).pin_memory()  # what a unified table holds
    chunk = 1 << 18
    for s in range(0, num_nodes, chunk):
        table[s:s + chunk].copy_(torch.randn(min(chunk, num_nodes - s), feat, device="cuda"))
    block, src_ids = first_layer_block(num_nodes, batch, fanouts, seed=0, skew=skew)
    nd, ns, e = block.num_dst_nodes, block.num_src_nodes, block.indices.numel()
    print(f"  {shape} block: {nd} dst, {ns} src, {e} edges (table {num_nodes} x {feat}; setup "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)

    def fresh() -> CSRGraph:  # a new batch each call: nothing derived from the block exists yet
        return CSRGraph(block.indptr, block.indices, ns, nd, trusted=True)

    push = plan_aggregation(block, feat, fused="push")
    pull = plan_aggregation(block, feat, fused="pull")
    alias = memory.kernel_view(table)
    want = aggregate(block, alias.index_select(0, src_ids), "mean")
    for p in (push, pull):
        err = float((aggregate(block, table, "mean", src_ids=src_ids, plan=p) - want).abs().max())
        if err > 1e-4:
            raise AssertionError(f"fused {p.fused} disagrees with gather-then-aggregate by {err}")
    prepare_aggregation(block, feat, reduce="mean", backward=False)
    ways = {
        "cold/gather+agg": lambda: aggregate(fresh(), memory.gather_rows(table, src_ids), "mean"),
        "cold/fused_push": lambda: aggregate(fresh(), table, "mean", src_ids=src_ids, plan=push),
        "cold/fused_pull": lambda: aggregate(fresh(), table, "mean", src_ids=src_ids, plan=pull),
        "prepared/gather+agg": lambda: aggregate(block, memory.gather_rows(table, src_ids), "mean"),
        "prepared/fused_push": lambda: aggregate(block, table, "mean", src_ids=src_ids, plan=push),
        "prepared/fused_pull": lambda: aggregate(block, table, "mean", src_ids=src_ids, plan=pull),
        "gather_only": lambda: memory.gather_rows(table, src_ids),
        "naive_zero_copy_gather": lambda: alias.index_select(0, src_ids),
    }
    ms = {}
    for way, fn in ways.items():
        ms[way] = cuda_time_ms(fn, warmup=2, repeat=repeat)
        print(f"    {way:>24}: {ms[way]:.3f} ms", flush=True)
    src_bytes = ns * feat * 4
    rec = {"device": torch.cuda.get_device_name(), "shape": shape, "num_nodes": num_nodes, "feat": feat, "batch": batch, "fanouts": list(fanouts),
           "block_dst": nd, "block_src": ns, "block_edges": e, "ms": ms,
           "src_rows_gbps": {k: src_bytes / v / 1e6 for k, v in ms.items()}}
    for mode in ("cold", "prepared"):
        best = min(ms[f"{mode}/fused_push"], ms[f"{mode}/fused_pull"])
        rec[f"speedup_{mode}_fused_vs_gather"] = ms[f"{mode}/gather+agg"] / best
    return rec


def plot(out: dict) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    spmm = out["spmm"]
    fig, axes = plt.subplots(1, 3, figsize=(20, 5), gridspec_kw={"width_ratios": [4, 4, 1.5]})
    for ax, key, title in ((axes[0], "speedup_fwd_vs_cusparse", "forward vs cuSPARSE (same dtype)"),
                           (axes[1], "speedup_fb_vs_cusparse_pret", "forward+backward vs cuSPARSE, prebuilt A^T")):
        for i, (dname, color) in enumerate((("float32", "C0"), ("bfloat16", "C1"), ("float16", "C2"))):
            rs = [r for r in spmm if r["dtype"] == dname]
            ax.bar([j * 4 + i for j in range(len(rs))], [r[key] for r in rs], color=color, label=dname)
        rs0 = [r for r in spmm if r["dtype"] == "float32"]
        ax.set_xticks([j * 4 + 1 for j in range(len(rs0))], [f"{r['graph']} F={r['F']}" for r in rs0],
                      rotation=90, fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.3, color="r", lw=0.8, ls="--", label="1.3x")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fused = out.get("fused") or []
    if fused:
        labels, vals = [], []
        for r in fused:
            for k in ("cold", "prepared"):
                labels.append(f"{r['shape']} {k}")
                vals.append(r[f"speedup_{k}_fused_vs_gather"])
        axes[2].bar(labels, vals)
        axes[2].axhline(1.3, color="r", lw=0.8, ls="--")
        axes[2].tick_params(axis="x", rotation=90)
        axes[2].set_title("fused vs gather+aggregate")
    fig.suptitle(f"datapath.ops.aggregate (sum) on {out['device']}")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "aggregate.png", dpi=110)


def summarize(out: dict) -> dict:
    spmm, fused, layers = out["spmm"], out.get("fused") or [], out.get("layers") or []
    s: dict[str, Any] = {}
    f32 = [r for r in spmm if r["dtype"] == "float32"]
    half = [r for r in spmm if r["dtype"] != "float32"]
    s["geomean_fwd_vs_cusparse"] = geomean([r["speedup_fwd_vs_cusparse"] for r in spmm])
    s["geomean_fwd_vs_cusparse_float32"] = geomean([r["speedup_fwd_vs_cusparse"] for r in f32])
    s["min_fwd_vs_cusparse"] = min((r["speedup_fwd_vs_cusparse"] for r in spmm), default=float("nan"))
    s["geomean_fb_vs_cusparse_pret"] = geomean([r["speedup_fb_vs_cusparse_pret"] for r in spmm])
    s["geomean_fb_vs_cusparse_pret_float32"] = geomean([r["speedup_fb_vs_cusparse_pret"] for r in f32])
    s["geomean_half_fwd_vs_cusparse_same_dtype"] = geomean([r["speedup_fwd_vs_cusparse"] for r in half])
    s["half_records_on_tensor_cores"] = sum(r["kernel_fwd"] == "tensor_core" for r in half)
    if half and "datapath_max_err" in half[0]:  # cuSPARSE accumulates half in half, ours in float32
        s["half_max_err_datapath"] = max(r["datapath_max_err"] for r in half)
        s["half_max_err_cusparse"] = max(r["cusparse_max_err"] for r in half)
        s["half_geomean_err_cusparse_over_datapath"] = geomean(
            [r["cusparse_max_err"] / r["datapath_max_err"] for r in half if r["datapath_max_err"] > 0])
    s["half_records"] = len(half)
    for r in fused:
        s[f"fused_{r['shape']}_cold"] = r["speedup_cold_fused_vs_gather"]
        s[f"fused_{r['shape']}_prepared"] = r["speedup_prepared_fused_vs_gather"]
    if layers:
        s["min_layer_fb_vs_pyg"] = min(r["speedup_fb"] for r in layers)
        s["geomean_layer_fb_vs_pyg"] = geomean([r["speedup_fb"] for r in layers])
    fx = out.get("fixed") or {}
    if fx:
        s["fixed_cost_event_ratio_vs_cusparse"] = fx["ratio_event_vs_cusparse"]
        s["fixed_cost_host_ratio_vs_cusparse"] = fx["ratio_host_vs_cusparse"]
    s["bar_fwd_every_record_le_cusparse"] = s["min_fwd_vs_cusparse"] >= 1.0
    s["bar_fwd_geomean_1.3"] = s["geomean_fwd_vs_cusparse"] >= 1.3
    s["bar_fb_geomean_1.3"] = s["geomean_fb_vs_cusparse_pret"] >= 1.3
    s["bar_half_1.5"] = s["geomean_half_fwd_vs_cusparse_same_dtype"] >= 1.5
    if fused:
        s["bar_fused_1.3"] = all(min(r["speedup_cold_fused_vs_gather"], r["speedup_prepared_fused_vs_gather"]) >= 1.3
                                 for r in fused)
    if layers:
        s["bar_layers_ge_pyg"] = s["min_layer_fb_vs_pyg"] >= 1.0
    if fx:
        s["bar_fixed_cost_1.5"] = fx["ratio_event_vs_cusparse"] <= 1.5
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small graphs, two widths, small fused batches")
    ap.add_argument("--candidates", action="store_true", help="also time every kernel on its own")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--graphs", default=None, help="comma list of graphs (default: the six of GNNAdvisor's tables)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds per way (median kept)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/aggregate.py needs a CUDA GPU")
    parts = args.parts.split(",")
    t_start = time.perf_counter()
    names = args.graphs.split(",") if args.graphs else (("citeseer", "ppi", "artist") if args.quick else GRAPHS)
    widths = (16, 128) if args.quick else WIDTHS
    dtypes = {d: DTYPES[d] for d in args.dtypes.split(",")}
    graphs = {n: seed_graph(n, device="cuda", seed=i)[0] for i, n in enumerate(names)}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "quick": args.quick, "summary": {}, "spmm": [],
                           "fused": [], "layers": [], "reorder": [], "fixed": {}, "errors": {},
                           "timing": "spmm, layers: median over --repeat rounds of the per-call mean of a batch of "
                                     "back-to-back calls (~2 ms of work, after a sync and one untimed call, CUDA "
                                     "events), the ways in a random order each round; fixed: one call between events, and host us per "
                                     "call; fused, reorder: one call between events, median"}

    def part(name: str, fn: Any) -> Any:
        if name not in parts:
            return None
        print(f"{name}:", flush=True)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - report the failure, keep the other parts
            import traceback  # noqa: PLC0415
            traceback.print_exc()
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            torch.cuda.empty_cache()
            write_result("aggregate", out)

    out["fixed"] = part("fixed", bench_fixed) or {}
    part("spmm", lambda: bench_spmm(graphs, widths, dtypes, args.repeat, out["spmm"], args.candidates,
                                    lambda: write_result("aggregate", out)))
    out["fused"] = [r for r in (
        part("fused", lambda: bench_fused("products", 400_000 if args.quick else 2_449_029, 100, 1024,
                                          (15, 10, 5), args.repeat, 0.8)),
        part("fused", lambda: bench_fused("reddit", 232_965, 602, 256 if args.quick else 1024, (15, 10, 5),
                                          args.repeat, 0.5)),
    ) if r]
    out["layers"] = part("layers", lambda: bench_layers(graphs, args.repeat)) or []
    out["reorder"] = part("reorder", lambda: bench_reorder(graphs, args.repeat)) or []
    out["summary"] = summarize(out) if out["spmm"] else {}
    out["wall_s"] = time.perf_counter() - t_start
    path = write_result("aggregate", out)
    try:
        plot(out)
    except Exception as exc:  # noqa: BLE001
        print(f"plot failed: {exc}")
    print(f"\nwrote {path} ({out['wall_s']:.0f} s)")
    if out["layers"]:
        print("\nlayers (fwd+bwd ms):")
        print_table([{k: r[k] for k in ("graph", "layer", "datapath_fb_ms", "pyg_fb_ms", "speedup_fb")}
                     for r in out["layers"]])
    for r in out["fused"]:
        print(f"\nfused first layer, {r['shape']} (ms):")
        print_table([{"way": k, "ms": v, "src_GB/s": r["src_rows_gbps"][k]} for k, v in r["ms"].items()])
    if out["spmm"]:
        print("\nspmm, sum aggregation (ms; fb = forward+backward):")
        print_table([{"graph": r["graph"][:10], "F": r["F"], "dtype": r["dtype"][:4],
                      "k": r["kernel_fwd"][:5] + "/" + str(r["kernel_bwd"])[:5],
                      "dp_fwd": r["datapath_fwd_ms"], "cs_fwd": r["cusparse_fwd_ms"], "dp_fb": r["datapath_fb_ms"],
                      "cs_pret_fb": r["cusparse_pret_fb_ms"], "x_fwd": r["speedup_fwd_vs_cusparse"],
                      "x_fb": r["speedup_fb_vs_cusparse_pret"]} for r in out["spmm"]])
    print("\nsummary:")
    print_table([{"metric": k, "value": v} for k, v in out["summary"].items()])


if __name__ == "__main__":
    main()
