"""Heterogeneous GNNs: relational layers vs PyG's, and R-GAT epochs with features out of core vs GPU-resident.

Layer records (forward + backward of one layer, median of interleaved rounds; peak memory above the
inputs and parameters): datapath's `RGCNConv` / `RGATConv` / `HGTConv` against PyG's, on sampled
`HeteroBlock`s of the IGBH-shaped and MAG-shaped presets and on a whole igbh-tiny graph, float32 and
float16.  PyG gets its natural inputs (RGCN/RGAT: the homogeneous x, edge_index, edge_type; HGT: the
dicts), built before timing; datapath's merged relations (`datapath.ops.typed.relations_into`, built
in the loader's thread in training) are built before timing too and their cost reported apart.

Epoch records: R-GAT on igbh-small trained by ``train-gnn``'s hetero branch twice, with every
feature table GPU-resident, and with a GPU cache of 25% of all feature bytes (spread over the types by
presampled reads per byte, `hetero_cache_rows`; the rest in
pinned host memory); same seeds, so the same batches.

    python benchmarks/hetero.py [--quick] [--skip-layers] [--skip-epochs]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import interleaved_ms, print_table, write_result  # noqa: E402

from datapath.graph import generate_hetero  # noqa: E402
from datapath.nn import HGTConv, RGATConv, RGCNConv  # noqa: E402
from datapath.ops import relations_into  # noqa: E402
from datapath.sampling import HeteroBlock, HeteroNeighborSampler  # noqa: E402

LAYERS = ("rgcn", "rgat", "hgt")
BREAKDOWN = ("train_s", "wait_s", "consumer_cpu_s", "sample_s", "gather_s", "producer_cpu_s", "producer_gpu_wait_s",
             "producer_queue_wait_s", "gpu_hit_rate", "host_read_bytes", "peak_gpu_bytes")
"""Per-epoch numbers of `train_hetero`'s history kept in the epoch records (see `apps.training.EpochStats`)."""


def _block_of_graph(hg: Any, dev: torch.device) -> HeteroBlock:
    """A whole graph as a layer (every node a source and a destination)."""
    from datapath.sampling import RelationBlock  # noqa: PLC0415

    rels = {et: RelationBlock(g.indptr.to(dev).long(), g.indices.to(dev).long(), g.num_src_nodes, g.num_dst_nodes,
                              max_degree=g.max_in_degree()) for et, g in hg.relations.items()}
    src = {t: torch.arange(n, device=dev) for t, n in hg.num_nodes.items()}
    return HeteroBlock(src, dict(hg.num_nodes), rels)


def shapes(quick: bool, dev: torch.device) -> dict[str, tuple[HeteroBlock, list]]:
    out = {}
    small = generate_hetero("igbh-small" if not quick else "igbh-tiny", device=dev)
    hg = small.graph.to("cuda")
    name = "igbh-small" if not quick else "igbh-tiny"
    for label, batch, fan, which in ((f"{name} seeds' layer b1024 f15", 1024, [15, 10], -1),
                                     (f"{name} input layer b256 f15,10", 256, [15, 10], 0)):
        seeds = small.train_idx[:batch].to(dev)
        blocks = HeteroNeighborSampler(fan, seed=1).sample(hg, ("paper", seeds))
        out[label] = (blocks[which], hg.edge_types, hg.node_types)
    mag = generate_hetero("mag", device=dev)
    hm = mag.graph.to("cuda")
    blocks = HeteroNeighborSampler([10, 10], seed=1).sample(hm, ("paper", mag.train_idx[:512].to(dev)))
    out["mag input layer b512 f10,10"] = (blocks[0], hm.edge_types, hm.node_types)
    if not quick:
        tiny = generate_hetero("igbh-tiny", device=dev)
        out["igbh-tiny whole graph"] = (_block_of_graph(tiny.graph, dev), tiny.graph.edge_types, tiny.graph.node_types)
    return out


def _homogeneous(block: HeteroBlock, x: dict[str, torch.Tensor], ets: list) -> tuple:
    off, acc = {}, 0
    for t in block.node_types:
        off[t] = acc
        acc += block.num_src_nodes[t]
    xs = torch.cat([x[t] for t in block.node_types])
    eis, typ = [], []
    for et, ei in block.to_pyg().items():
        eis.append(torch.stack([ei[0] + off[et[0]], ei[1] + off[et[2]]]))
        typ.append(torch.full((ei.shape[1],), ets.index(et), device=xs.device))
    return xs, torch.cat(eis, 1), torch.cat(typ), off


def _layers(kind: str, width: int, ets: list, nts: list, heads: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    import torch_geometric.nn as pyg  # noqa: PLC0415

    if kind == "rgcn":
        ours, theirs = RGCNConv(width, width, ets), pyg.RGCNConv(width, width, len(ets))
    elif kind == "rgat":
        ours, theirs = RGATConv(width, width // heads, ets, heads=heads), pyg.RGATConv(width, width // heads, len(ets),
                                                                                        heads=heads)
    else:
        ours, theirs = HGTConv(width, width, (nts, ets), heads=heads), pyg.HGTConv(width, width, (nts, ets), heads)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    return ours, theirs


def _peak_gb(fn: Any) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def layer_records(quick: bool, width: int, heads: int, reps: int) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    recs = []
    for gname, (block, ets, nts) in shapes(quick, dev).items():
        edges = sum(block.num_edges.values())
        print(f"== {gname}: {block} ({edges:,} edges)", flush=True)
        for dtype in (torch.float32, torch.float16):
            g = torch.Generator(device=dev).manual_seed(0)
            x = {t: torch.randn(n, width, generator=g, device=dev, dtype=dtype).requires_grad_()
                 for t, n in block.num_src_nodes.items()}
            for kind in LAYERS:
                ours, theirs = _layers(kind, width, ets, nts, heads)
                ours, theirs = ours.to(dev, dtype), theirs.to(dev, dtype)
                t0 = time.perf_counter()
                for t in block.dst_types:
                    relations_into(block, t)
                torch.cuda.synchronize()
                prep_ms = (time.perf_counter() - t0) * 1e3
                if kind in ("rgcn", "rgat"):
                    xs, ei, et, off = _homogeneous(block, {t: v.detach() for t, v in x.items()}, ets)
                    xs.requires_grad_()

                    def pyg_step() -> None:
                        out = theirs(xs, ei, et)
                        out.float().sum().backward()
                else:
                    xt = {t: v.detach().requires_grad_() for t, v in x.items()}
                    ed = block.to_pyg()

                    def pyg_step() -> None:
                        out = theirs(xt, ed)
                        sum(v.float().sum() for v in out.values() if v is not None).backward()

                def ours_step() -> None:
                    out = ours(block, x)
                    sum(v.float().sum() for v in out.values()).backward()

                ms = interleaved_ms({"pyg": pyg_step, "datapath": ours_step}, reps)
                peaks = {}
                for name, fn in (("pyg", pyg_step), ("datapath", ours_step)):
                    for p in (*ours.parameters(), *theirs.parameters(), *x.values()):
                        p.grad = None
                    try:
                        peaks[name] = _peak_gb(fn) if not math.isnan(ms[name]) else float("nan")
                    except torch.OutOfMemoryError:
                        peaks[name] = float("nan")
                rec = {"layer": kind, "graph": gname, "dtype": str(dtype).replace("torch.", ""), "edges": edges,
                       "pyg_ms": ms["pyg"], "datapath_ms": ms["datapath"], "speedup": ms["pyg"] / ms["datapath"],
                       "pyg_peak_gb": peaks["pyg"], "datapath_peak_gb": peaks["datapath"],
                       "datapath_prepare_ms": prep_ms, "device": torch.cuda.get_device_name()}
                recs.append(rec)
                print(f"   {kind:4s} {rec['dtype']:8s} pyg {ms['pyg']:8.2f} ms  datapath {ms['datapath']:8.2f} ms  "
                      f"x{rec['speedup']:.2f}  peak {peaks['pyg']:.3f} / {peaks['datapath']:.3f} GB", flush=True)
                del ours, theirs
                torch.cuda.empty_cache()
    return recs


def epoch_records(quick: bool, epochs: int, workers: int = 1) -> list[dict[str, Any]]:
    from datapath.apps.train_gnn import TrainConfig  # noqa: PLC0415
    from datapath.apps.train_hetero import train_hetero  # noqa: PLC0415

    dataset = "igbh-tiny" if quick else "igbh-small"
    common = dict(dataset=dataset, model="rgat", epochs=epochs, batch_size=1024, fanouts=(15, 10), hidden=128,
                  heads=4, lr=3e-3, dropout=0.2, eval_nodes=20_000, seed=0, prefetch=2)
    runs = {}
    for way, kw in (("resident", {"features_on": "cuda", "graph_on": "cuda"}),
                    ("cache25", {"gpu_cache": "25%", "graph_on": "cuda"})):
        print(f"== R-GAT {dataset} {way}", flush=True)
        runs[way] = train_hetero(TrainConfig(**common, **kw), num_workers=workers)
        torch.cuda.empty_cache()

    def epoch_s(r: dict) -> float:  # the epochs after the first (warm-up: kernel builds, allocator growth)
        rows = r["history"][1:] or r["history"]
        return statistics.median(h["epoch_s"] for h in rows)

    def breakdown(r: dict) -> dict[str, float]:  # where an epoch's time went (medians over the epochs after the first)
        rows = r["history"][1:] or r["history"]
        keys = [k for k in BREAKDOWN if k in rows[0]]
        return {k: statistics.median(h[k] for h in rows) for k in keys}

    res, cache = runs["resident"], runs["cache25"]
    return [{"model": "rgat", "dataset": dataset, "epoch_s": epoch_s(cache), "resident_epoch_s": epoch_s(res),
             "ratio": epoch_s(cache) / epoch_s(res), "gpu_cache_frac": cache["gpu_cache_frac"],
             "test_acc": cache["test_acc"], "resident_test_acc": res["test_acc"],
             "epochs": epochs, "epoch_s_all": [h["epoch_s"] for h in cache["history"]],
             "resident_epoch_s_all": [h["epoch_s"] for h in res["history"]],
             "breakdown": breakdown(cache), "resident_breakdown": breakdown(res),
             "gpu_cache_rows": cache.get("gpu_cache_rows"), "loader_workers": workers,
             "batches": cache["history"][-1]["batches"], "feature_bytes": cache["feature_bytes"],
             "device": torch.cuda.get_device_name()}]


def plot(layers: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    labels = [f"{r['layer']} {r['dtype'][5:] if r['dtype'].startswith('float') else r['dtype']}\n{r['graph'][:22]}"
              for r in layers]
    xs = range(len(layers))
    axes[0].bar(xs, [r["speedup"] if not math.isnan(r["speedup"]) else 0 for r in layers], color="tab:blue")
    axes[0].axhline(2.0, color="red", ls="--", lw=1, label="bar: 2x")
    axes[0].axhline(1.0, color="gray", lw=1)
    axes[0].set_ylabel("PyG time / datapath time (fwd+bwd)")
    axes[0].set_yscale("log")
    axes[0].legend()
    w = 0.4
    axes[1].bar([i - w / 2 for i in xs], [r["pyg_peak_gb"] for r in layers], w, label="PyG")
    axes[1].bar([i + w / 2 for i in xs], [r["datapath_peak_gb"] for r in layers], w, label="datapath")
    axes[1].set_ylabel("peak GPU memory above inputs (GB)")
    axes[1].set_yscale("log")
    axes[1].legend()
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    fig.suptitle(f"relational layers vs PyG on {layers[0]['device'] if layers else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (igbh-tiny) for a trial run")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--skip-epochs", action="store_true")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--loader-workers", type=int, default=1, help="producer threads of the epochs' loader")
    ap.add_argument("--name", default="hetero")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/hetero.py needs a CUDA GPU")
        return 1
    layers = [] if args.skip_layers else layer_records(args.quick, args.width, args.heads, args.reps)
    epochs = [] if args.skip_epochs else epoch_records(args.quick, args.epochs, args.loader_workers)
    summary: dict[str, Any] = {}
    if layers:
        print_table(layers, ["layer", "graph", "dtype", "pyg_ms", "datapath_ms", "speedup", "pyg_peak_gb",
                             "datapath_peak_gb", "datapath_prepare_ms"])
        ok = [r for r in layers if not math.isnan(r["speedup"])]
        for kind in LAYERS:
            sp = [r["speedup"] for r in ok if r["layer"] == kind]
            if sp:
                summary[f"{kind}_geomean_speedup"] = math.exp(sum(map(math.log, sp)) / len(sp))
                summary[f"{kind}_min_speedup"] = min(sp)
        summary["geomean_speedup"] = math.exp(sum(math.log(r["speedup"]) for r in ok) / max(len(ok), 1))
        summary["never_slower"] = all(r["speedup"] >= 1.0 for r in ok)
        summary["peak_le_pyg"] = all(r["datapath_peak_gb"] <= r["pyg_peak_gb"] for r in ok)
        summary["pyg_failed"] = [f"{r['layer']} {r['dtype']} {r['graph']}" for r in layers if math.isnan(r["pyg_ms"])]
    if epochs:
        print_table(epochs, ["model", "dataset", "epoch_s", "resident_epoch_s", "ratio", "gpu_cache_frac", "test_acc",
                             "resident_test_acc"])
        e = epochs[0]
        summary["epoch_ratio"] = e["ratio"]
        summary["acc_gap_points"] = 100 * abs(e["test_acc"] - e["resident_test_acc"])
    print("summary:", summary)
    path = write_result(args.name, {"layers": layers, "epochs": epochs, "summary": summary,
                                    "settings": vars(args)})
    if layers:
        try:
            plot(layers, path.with_suffix(".png"))
        except Exception as exc:  # noqa: BLE001 - the numbers are written already
            print(f"plot failed: {exc}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
