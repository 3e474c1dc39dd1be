"""B3: GNN aggregation kernels (GNNAdvisor-style) vs cuSPARSE, the PyG way and PyG layers; fused host path.

Parts (BENCHMARKS.md, B3):
  spmm     sum aggregation, forward and forward+backward (gradient of x), on synthetic power-law
           graphs with the node/edge counts of GNNAdvisor's Type I/II/III datasets, widths 16, 64,
           128, 602.  Ways:
             datapath        datapath.ops.aggregate (neighbor groups, backward over the cached transpose)
             dp_atomic       the same, backward by atomic scatter (plan.backward="atomic")
             cusparse        torch.sparse.mm with a CSR matrix (cuSPARSE), autograd as a user writes it
             cusparse_pret   torch.sparse.mm forward, backward with a prebuilt transposed CSR (the best
                             cuSPARSE can do; the bar is measured against the faster of the two)
             index_add       x.index_select + index_add_ (the PyG way)
             scatter_reduce  x.index_select + scatter_reduce(sum)
  variants mean / GCN-normalized / edge-weighted at width 64 vs cuSPARSE with the matching values.
  layers   PyG SAGEConv / GCNConv vs datapath.nn with the same weights, forward+backward.
  model    ngs x dw sweep of the forward kernel on two graphs; the analytical model's pick is marked.
  fused    first layer of a products-shaped GraphSAGE batch (2.4M x 100 fp32 table in pinned host
           memory, batch 1024, fanouts 15/10/5): fused gather+aggregate (push and pull) vs gather
           (datapath unified gather / naive zero-copy / CPU gather + copy) then aggregate.

Run:  PYTHONPATH=src:. python benchmarks/aggregate.py [--quick]
Writes benchmarks/results/aggregate.json and aggregate.png; prints the summary table last.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch

import datapath  # noqa: E402, F401
from benchmarks._common import RESULTS_DIR, cuda_time_ms, print_table, write_result  # noqa: E402
from datapath._runtime import cuda_alias, device_label, pinned_empty, require_cuda  # noqa: E402
from datapath.ops import CSRGraph, aggregate, plan_aggregation  # noqa: E402
from datapath.ops._random_graph import power_law_csr  # noqa: E402

# GNNAdvisor Table 1 (nodes, edges)
DATASETS = {
    "citeseer": (3_327, 9_464),
    "ppi": (56_944, 818_716),
    "ovcar-8h": (1_890_931, 3_946_402),
    "amazon0505": (410_236, 4_878_875),
    "artist": (50_515, 1_638_396),
    "soc-BlogCatalog": (88_784, 2_093_195),
}
WIDTHS = (16, 64, 128, 602)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def make_graph(name: str, n: int, e: int, seed: int) -> CSRGraph:
    # row lengths and source popularity both ~ rank^-0.6: symmetric-looking degree skew, as in the papers'
    # undirected graphs (hubs with a few thousand edges on the larger graphs)
    g = power_law_csr(n, n, e, seed=seed, alpha=1.2, src_alpha=0.6, self_loops=False, index_dtype=torch.int32,
                      zero_rows=0.02)
    return CSRGraph(g.indptr.cuda(), g.indices.cuda(), n, n)


class _PretransposedSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.at = at
        return torch.sparse.mm(a, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return torch.sparse.mm(ctx.at, g), None, None


def csr_tensors(g: CSRGraph, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, A^T) as torch sparse CSR tensors (cuSPARSE); values per CSR position."""
    n_dst, n_src = g.num_dst_nodes, g.num_src_nodes
    a = torch.sparse_csr_tensor(g.indptr.to(torch.int32), g.indices, values, (n_dst, n_src))
    at = a.t().to_sparse_csr()
    at = torch.sparse_csr_tensor(at.crow_indices().to(torch.int32), at.col_indices().to(torch.int32),
                                 at.values(), (n_src, n_dst))
    return a, at


def time_pair(fwd: Any, x: torch.Tensor, gy: torch.Tensor, repeat: int) -> tuple[float, float]:
    """(forward ms without autograd, forward+backward ms) for ``fwd(x)``."""
    with torch.no_grad():
        t_f = cuda_time_ms(lambda: fwd(x), warmup=2, repeat=repeat)

    def step() -> None:
        x.grad = None
        fwd(x).backward(gy)
    t_fb = cuda_time_ms(step, warmup=2, repeat=repeat)
    return t_f, t_fb


def bench_spmm(graphs: dict[str, CSRGraph], widths: tuple[int, ...], repeat: int, rows: list[dict],
               checkpoint: Any = None) -> list[dict]:
    """Appends one row per (graph, width) to ``rows``; calls ``checkpoint()`` after each graph."""
    for name, g in graphs.items():
        e = g.indices.numel()
        dst = torch.repeat_interleave(torch.arange(g.num_dst_nodes, device="cuda"),
                                      (g.indptr[1:] - g.indptr[:-1]), output_size=e)
        src = g.indices.long()
        t0 = time.perf_counter()
        a, at = csr_tensors(g, torch.ones(e, device="cuda"))
        torch.cuda.synchronize()
        t_csr = (time.perf_counter() - t0) * 1e3
        # one-time costs of our cached structures
        probe = torch.randn(g.num_src_nodes, 1, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        aggregate(g, probe).sum().backward()
        torch.cuda.synchronize()
        t_prep = (time.perf_counter() - t0) * 1e3
        for f in widths:
            x = torch.randn(g.num_src_nodes, f, device="cuda", requires_grad=True)
            gy = torch.randn(g.num_dst_nodes, f, device="cuda")
            atomic = plan_aggregation(g, f, backward="atomic")

            def idx_add(x: torch.Tensor) -> torch.Tensor:
                return torch.zeros(g.num_dst_nodes, x.shape[1], device="cuda").index_add_(0, dst, x.index_select(0, src))

            def scat(x: torch.Tensor) -> torch.Tensor:
                m = x.index_select(0, src)
                return torch.zeros(g.num_dst_nodes, x.shape[1], device="cuda").scatter_reduce(
                    0, dst.unsqueeze(1).expand_as(m), m, "sum")

            ways = {
                "datapath": lambda x: aggregate(g, x),
                "dp_atomic": lambda x: aggregate(g, x, plan=atomic),
                "cusparse": lambda x: torch.sparse.mm(a, x),
                "cusparse_pret": lambda x: _PretransposedSpMM.apply(x, a, at),
                "index_add": idx_add,
                "scatter_reduce": scat,
            }
            res: dict[str, tuple[float, float]] = {}
            for way, fn in ways.items():
                try:
                    res[way] = time_pair(fn, x, gy, repeat)
                except (RuntimeError, torch.OutOfMemoryError) as exc:  # report, never hide
                    print(f"  {name} F={f} {way}: failed ({str(exc)[:120]})")
                    res[way] = (float("nan"), float("nan"))
                    torch.cuda.empty_cache()
            best_cs = min(res["cusparse"][1], res["cusparse_pret"][1])
            row = {
                "graph": name, "nodes": g.num_dst_nodes, "edges": e, "F": f,
                "plan": str(plan_aggregation(g, f)),
                **{f"{w}_fwd_ms": v[0] for w, v in res.items()},
                **{f"{w}_fb_ms": v[1] for w, v in res.items()},
                "speedup_fwd_vs_cusparse": res["cusparse"][0] / res["datapath"][0],
                "speedup_fb_vs_cusparse": res["cusparse"][1] / res["datapath"][1],
                "speedup_fb_vs_best_cusparse": best_cs / res["datapath"][1],
                "speedup_fb_vs_index_add": res["index_add"][1] / res["datapath"][1],
                "speedup_fb_vs_scatter_reduce": res["scatter_reduce"][1] / res["datapath"][1],
                "atomic_bwd_vs_transpose": res["dp_atomic"][1] / res["datapath"][1],
                "one_time_csr_build_ms_cusparse": t_csr, "one_time_prep_ms_datapath": t_prep,
                "gbps_fwd_datapath": e * f * 4 / res["datapath"][0] / 1e6,
            }
            rows.append(row)
            print(f"  {name:>16} F={f:<4} fwd {res['datapath'][0]:.3f} ms (cuSPARSE {res['cusparse'][0]:.3f})  "
                  f"fwd+bwd {res['datapath'][1]:.3f} ms (cuSPARSE {res['cusparse'][1]:.3f}, pret "
                  f"{res['cusparse_pret'][1]:.3f}, index_add {res['index_add'][1]:.3f}, atomic-bwd "
                  f"{res['dp_atomic'][1]:.3f})", flush=True)
            del x, gy
        if checkpoint is not None:
            checkpoint()
    return rows


def bench_variants(graphs: dict[str, CSRGraph], repeat: int, f: int = 64) -> list[dict]:
    rows = []
    for name, g in graphs.items():
        e = g.indices.numel()
        deg_in = (g.indptr[1:] - g.indptr[:-1]).clamp(min=1).float()
        deg_out = torch.bincount(g.indices.long(), minlength=g.num_src_nodes).clamp(min=1).float()
        dst = torch.repeat_interleave(torch.arange(g.num_dst_nodes, device="cuda"), g.indptr[1:] - g.indptr[:-1],
                                      output_size=e)
        w = torch.rand(e, device="cuda")
        vals = {
            "mean": 1.0 / deg_in[dst],
            "gcn": (deg_in[dst] * deg_out[g.indices.long()]).rsqrt(),
            "weighted": w,
        }
        x = torch.randn(g.num_src_nodes, f, device="cuda", requires_grad=True)
        gy = torch.randn(g.num_dst_nodes, f, device="cuda")
        ours = {
            "mean": lambda x: aggregate(g, x, "mean"),
            "gcn": lambda x: aggregate(g, x, norm="gcn"),
            "weighted": lambda x: aggregate(g, x, edge_weight=w),
        }
        for kind, v in vals.items():
            a, at = csr_tensors(g, v)
            t_dp = time_pair(ours[kind], x, gy, repeat)
            t_cs = time_pair(lambda x: _PretransposedSpMM.apply(x, a, at), x, gy, repeat)
            t_cs_auto = time_pair(lambda x: torch.sparse.mm(a, x), x, gy, repeat)
            rows.append({"graph": name, "F": f, "variant": kind, "datapath_fwd_ms": t_dp[0],
                         "datapath_fb_ms": t_dp[1], "cusparse_fwd_ms": t_cs_auto[0], "cusparse_fb_ms": t_cs_auto[1],
                         "cusparse_pret_fb_ms": t_cs[1],
                         "speedup_fb_vs_best_cusparse": min(t_cs[1], t_cs_auto[1]) / t_dp[1]})
    return rows


def bench_layers(graphs: dict[str, CSRGraph], repeat: int, fin: int = 128, fout: int = 64) -> list[dict]:
    try:
        import torch_geometric.nn as pyg  # noqa: PLC0415
    except ImportError:
        print("  PyG not importable: layer comparison skipped")
        return []
    from datapath.nn import GCNConv, SAGEConv  # noqa: PLC0415
    rows = []
    for name, g in graphs.items():
        e = g.indices.numel()
        dst = torch.repeat_interleave(torch.arange(g.num_dst_nodes, device="cuda"), g.indptr[1:] - g.indptr[:-1],
                                      output_size=e)
        edge_index = torch.stack([g.indices.long(), dst])
        x = torch.randn(g.num_src_nodes, fin, device="cuda", requires_grad=True)
        gy = torch.randn(g.num_dst_nodes, fout, device="cuda")
        for kind, ours, theirs in (
            ("SAGEConv", SAGEConv(fin, fout), pyg.SAGEConv(fin, fout)),
            ("GCNConv", GCNConv(fin, fout), pyg.GCNConv(fin, fout, add_self_loops=False, cached=True)),
        ):
            theirs = theirs.cuda()
            ours = ours.cuda()
            ours.load_state_dict(theirs.state_dict(), strict=False)
            t_ours = time_pair(lambda x: ours(g, x), x, gy, repeat)
            t_pyg = time_pair(lambda x: theirs(x, edge_index), x, gy, repeat)
            rows.append({"graph": name, "layer": kind, "in": fin, "out": fout, "datapath_fwd_ms": t_ours[0],
                         "datapath_fb_ms": t_ours[1], "pyg_fwd_ms": t_pyg[0], "pyg_fb_ms": t_pyg[1],
                         "speedup_fwd": t_pyg[0] / t_ours[0], "speedup_fb": t_pyg[1] / t_ours[1]})
    return rows


def bench_model(graphs: dict[str, CSRGraph], repeat: int) -> list[dict]:
    """Forward time over an ngs x dw grid; the analytical model's choice is flagged."""
    rows = []
    for name in ("amazon0505", "soc-BlogCatalog", "artist"):
        if name not in graphs:
            continue
        g = graphs[name]
        for f in (64, 602):
            x = torch.randn(g.num_src_nodes, f, device="cuda")
            model = plan_aggregation(g, f)
            grid = []
            for dw in sorted({8, 16, 32, model.dw}):
                for ngs in (1, 2, 4, 8, 16, 32, 64):
                    p = plan_aggregation(g, f, ngs=ngs, dw=dw)
                    t = cuda_time_ms(lambda p=p: aggregate(g, x, plan=p), warmup=2, repeat=repeat)
                    grid.append({"graph": name, "F": f, "dw": dw, "ngs": ngs, "fwd_ms": t,
                                 "model_pick": dw == model.dw and ngs == model.ngs})
            best = min(grid, key=lambda r: r["fwd_ms"])
            pick = [r for r in grid if r["model_pick"]]
            if not pick:  # the model's ngs is not on the grid: time it too
                t = cuda_time_ms(lambda: aggregate(g, x, plan=model), warmup=2, repeat=repeat)
                pick = [{"graph": name, "F": f, "dw": model.dw, "ngs": model.ngs, "fwd_ms": t, "model_pick": True}]
                grid.append(pick[0])
            for r in grid:
                r["best_ms"] = best["fwd_ms"]
            rows.extend(grid)
            print(f"  model {name} F={f}: pick dw={model.dw} ngs={model.ngs} {pick[0]['fwd_ms']:.3f} ms, best "
                  f"dw={best['dw']} ngs={best['ngs']} {best['fwd_ms']:.3f} ms", flush=True)
    return rows


def products_block(num_nodes: int, batch: int, fanouts: tuple[int, ...], seed: int) -> tuple[CSRGraph, torch.Tensor]:
    """A synthetic first-layer block of a GraphSAGE batch: (block CSR, src_ids into the table).

    Seeds expand by the fanouts (innermost last); the first layer's destinations are the
    nodes reached after all but the first-layer hop; each gets ``fanouts[0]`` neighbors drawn
    from a power-law popularity over the whole graph (hubs recur, as on ogbn-products).
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pop = torch.arange(1, num_nodes + 1, device="cuda", dtype=torch.float32).pow(-0.8)
    perm = torch.randperm(num_nodes, device="cuda", generator=gen)
    nodes = perm[torch.randperm(num_nodes, device="cuda", generator=gen)[:batch]]
    for fan in reversed(fanouts[1:]):  # expand the seeds to the first layer's destinations
        nb = perm[torch.multinomial(pop, nodes.numel() * fan, replacement=True, generator=gen)]
        nodes = torch.unique(torch.cat([nodes, nb]))
    dst_nodes = nodes[torch.randperm(nodes.numel(), device="cuda", generator=gen)]
    nd = dst_nodes.numel()
    fan = fanouts[0]
    nbrs = perm[torch.multinomial(pop, nd * fan, replacement=True, generator=gen)]
    # local ids: destinations first, then the new sources in first-seen order
    allv = torch.cat([dst_nodes, nbrs])
    uniq, inv = torch.unique(allv, return_inverse=True)
    first = torch.full((uniq.numel(),), allv.numel(), device="cuda", dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(allv.numel(), device="cuda"), "amin")
    order = torch.argsort(first)
    local = torch.empty_like(order)
    local[order] = torch.arange(order.numel(), device="cuda")
    src_ids = uniq[order]
    indices = local[inv[nd:]].to(torch.int32)
    indptr = torch.arange(0, nd * fan + 1, fan, device="cuda", dtype=torch.int64)
    return CSRGraph(indptr, indices, src_ids.numel(), nd), src_ids


def bench_fused(num_nodes: int, feat: int, batch: int, fanouts: tuple[int, ...], repeat: int) -> dict:
    from datapath.unified_tensor import gather  # noqa: PLC0415
    t0 = time.perf_counter()
    host = pinned_empty((num_nodes, feat), torch.float32)  # the memory a unified tensor holds
    chunk = 1 << 20
    for s in range(0, num_nodes, chunk):
        host[s:s + chunk].copy_(torch.randn(min(chunk, num_nodes - s), feat, device="cuda"))
    table = host
    alias = cuda_alias(host)
    block, src_ids = products_block(num_nodes, batch, fanouts, seed=0)
    src_cpu = src_ids.cpu()
    nd, ns, e = block.num_dst_nodes, block.num_src_nodes, block.indices.numel()
    print(f"  products block: {nd} dst, {ns} src, {e} edges (table {num_nodes} x {feat}; setup "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)

    def fresh() -> CSRGraph:  # a new batch each step: no cached transpose / groups
        return CSRGraph(block.indptr, block.indices, ns, nd)

    push = plan_aggregation(block, feat, fused="push")
    pull = plan_aggregation(block, feat, fused="pull")
    ways = {
        "gather_dp+agg": lambda: aggregate(fresh(), gather(table, src_ids), "mean"),
        "gather_naive_zc+agg": lambda: aggregate(fresh(), torch.index_select(alias, 0, src_ids), "mean"),
        "gather_cpu_copy+agg": lambda: aggregate(fresh(), host[src_cpu].to("cuda"), "mean"),
        "fused_push": lambda: aggregate(fresh(), table, "mean", src_ids=src_ids, plan=push),
        "fused_push+x_dst": lambda: (aggregate(fresh(), table, "mean", src_ids=src_ids, plan=push),
                                     gather(table, src_ids[:nd])),
        "fused_pull": lambda: aggregate(fresh(), table, "mean", src_ids=src_ids, plan=pull),
        "gather_dp_only": lambda: gather(table, src_ids),
    }
    want = aggregate(block, alias.index_select(0, src_ids), "mean")
    for way in ("fused_push", "fused_pull"):
        got = ways[way]()
        err = float((got - want).abs().max())
        if err > 1e-4:
            raise AssertionError(f"{way} disagrees with gather-then-aggregate by {err}")
    ms = {}
    for way, fn in ways.items():
        ms[way] = cuda_time_ms(fn, warmup=2, repeat=max(3, repeat // (4 if "cpu" in way else 1)))
        print(f"  {way:>22}: {ms[way]:.2f} ms", flush=True)
    src_bytes = ns * feat * 4
    best_gather = min(ms["gather_dp+agg"], ms["gather_naive_zc+agg"], ms["gather_cpu_copy+agg"])
    return {
        "num_nodes": num_nodes, "feat": feat, "batch": batch, "fanouts": list(fanouts),
        "block_dst": nd, "block_src": ns, "block_edges": e, "ms": ms,
        "src_rows_gbps": {k: src_bytes / v / 1e6 for k, v in ms.items()},
        "speedup_push_vs_gather_dp": ms["gather_dp+agg"] / ms["fused_push"],
        "speedup_push_vs_best_gather": best_gather / ms["fused_push"],
        "speedup_push_xdst_vs_gather_dp": ms["gather_dp+agg"] / ms["fused_push+x_dst"],
        "speedup_push_vs_naive_zc": ms["gather_naive_zc+agg"] / ms["fused_push"],
        "speedup_push_vs_cpu_copy": ms["gather_cpu_copy+agg"] / ms["fused_push"],
        "speedup_pull_vs_gather_dp": ms["gather_dp+agg"] / ms["fused_pull"],
    }


def plot(spmm: list[dict], fused: dict) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{r['graph']}\nF={r['F']}" for r in spmm]
    xs = range(len(spmm))
    wd = 0.27
    ax1.bar([i - wd for i in xs], [r["speedup_fb_vs_best_cusparse"] for r in spmm], wd, label="vs best cuSPARSE")
    ax1.bar(list(xs), [r["speedup_fb_vs_cusparse"] for r in spmm], wd, label="vs torch.sparse.mm autograd")
    ax1.bar([i + wd for i in xs], [r["speedup_fb_vs_index_add"] for r in spmm], wd, label="vs index_add_")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.axhline(1.3, color="r", lw=0.8, ls="--", label="bar 1.3x")
    ax1.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax1.set_ylabel("speedup, forward + backward")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.set_title(f"datapath.ops.aggregate (sum) on {device_label()}")
    if fused:
        names = list(fused["ms"])
        ax2.barh(names, [fused["ms"][n] for n in names])
        ax2.set_xlabel("ms (first-layer aggregation, products-shaped batch)")
        ax2.set_title("fused host path")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "aggregate.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small graphs, two widths, a small fused batch")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="skip the remaining (lower-priority) parts once this much time has passed")
    args = ap.parse_args()
    require_cuda("benchmarks/aggregate.py")
    t_start = time.perf_counter()
    names = ("citeseer", "ppi", "artist") if args.quick else tuple(DATASETS)
    widths = (16, 128) if args.quick else WIDTHS
    repeat = 5
    graphs = {n: make_graph(n, *DATASETS[n], seed=i) for i, n in enumerate(names)}
    out: dict[str, Any] = {"quick": args.quick, "summary": {}, "spmm": [], "fused": {}, "variants": [],
                           "layers": [], "model_sweep": [], "skipped": [], "errors": {}}

    def part(name: str, fn: Any) -> Any:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"{name}: skipped (time budget)", flush=True)
            out["skipped"].append(name)
            return None
        print(f"{name}:", flush=True)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - report the failure, keep the other parts
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            torch.cuda.empty_cache()

    out["fused"] = part("fused", lambda: bench_fused(400_000 if args.quick else 2_400_000, 100,
                                                      256 if args.quick else 1024, (15, 10, 5), repeat)) or {}
    write_result("aggregate", out)
    part("spmm", lambda: bench_spmm(graphs, widths, repeat, out["spmm"], lambda: write_result("aggregate", out)))
    write_result("aggregate", out)
    out["variants"] = part("variants", lambda: bench_variants(graphs, repeat)) or []
    out["layers"] = part("layers", lambda: bench_layers(graphs, repeat)) or []
    write_result("aggregate", out)
    out["model_sweep"] = part("model", lambda: bench_model(graphs, 3)) or []
    spmm, fused, variants, layers = out["spmm"], out["fused"], out["variants"], out["layers"]
    summary: dict[str, Any] = {
        "geomean_fb_vs_cusparse_autograd": geomean([r["speedup_fb_vs_cusparse"] for r in spmm]),
        "geomean_fb_vs_best_cusparse": geomean([r["speedup_fb_vs_best_cusparse"] for r in spmm]),
        "geomean_fwd_vs_cusparse": geomean([r["speedup_fwd_vs_cusparse"] for r in spmm]),
        "geomean_fb_vs_index_add": geomean([r["speedup_fb_vs_index_add"] for r in spmm]),
        "geomean_fb_vs_scatter_reduce": geomean([r["speedup_fb_vs_scatter_reduce"] for r in spmm]),
        "geomean_atomic_bwd_vs_transpose": geomean([r["atomic_bwd_vs_transpose"] for r in spmm]),
        "geomean_variants_fb_vs_best_cusparse": geomean([r["speedup_fb_vs_best_cusparse"] for r in variants]),
        "geomean_layers_fb_vs_pyg": geomean([r["speedup_fb"] for r in layers]),
        "fused_push_vs_gather_dp": fused.get("speedup_push_vs_gather_dp", float("nan")),
        "fused_push_vs_best_gather": fused.get("speedup_push_vs_best_gather", float("nan")),
    }
    summary["bar_spmm_1.3x_vs_torch_sparse_mm"] = summary["geomean_fb_vs_cusparse_autograd"] >= 1.3
    summary["bar_spmm_1.3x_vs_best_cusparse"] = summary["geomean_fb_vs_best_cusparse"] >= 1.3
    summary["bar_fused_1.3x_vs_gather_dp"] = summary["fused_push_vs_gather_dp"] >= 1.3
    out["summary"] = summary
    out["wall_s"] = time.perf_counter() - t_start
    path = write_result("aggregate", out)
    try:
        plot(spmm, fused)
    except Exception as exc:  # noqa: BLE001
        print(f"plot failed: {exc}")
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    if layers:
        print("\nlayers (fwd+bwd ms):")
        print_table([{k: r[k] for k in ("graph", "layer", "datapath_fb_ms", "pyg_fb_ms", "speedup_fb")}
                     for r in layers])
    if variants:
        print("\nvariants at F=64 (fwd+bwd ms):")
        print_table([{k: r[k] for k in ("graph", "variant", "datapath_fb_ms", "cusparse_fb_ms",
                                        "cusparse_pret_fb_ms", "speedup_fb_vs_best_cusparse")} for r in variants])
    if fused:
        print("\nfused first layer, products shape (ms):")
        print_table([{"way": k, "ms": v, "src_GB/s": fused["src_rows_gbps"][k]} for k, v in fused["ms"].items()])
    print("\nsummary:")
    print_table([{"metric": k, "value": v} for k, v in summary.items()])
    print("\nspmm, sum aggregation (ms; fb = forward+backward):")
    print_table([{"graph": r["graph"], "F": r["F"], "dp_fwd": r["datapath_fwd_ms"], "cs_fwd": r["cusparse_fwd_ms"],
                  "dp_fb": r["datapath_fb_ms"], "dp_atomic_fb": r["dp_atomic_fb_ms"], "cs_fb": r["cusparse_fb_ms"],
                  "cs_pret_fb": r["cusparse_pret_fb_ms"], "idx_add_fb": r["index_add_fb_ms"],
                  "x_cs": r["speedup_fb_vs_cusparse"], "x_best_cs": r["speedup_fb_vs_best_cusparse"]} for r in spmm])


if __name__ == "__main__":
    main()
