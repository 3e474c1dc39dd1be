"""The seed papers' experiment: full-graph GCN (2 layers, hidden 16) and GIN (5 layers, hidden 64), training and
inference, datapath.nn vs PyG on the same GPU, on graphs shaped like GNNAdvisor's / TC-GNN's datasets.

Graphs: `datapath.testing.graphs.seed_graph` (each dataset's node and edge counts, community structure,
random node order), random float32 features of the dataset's width, random labels of its class count.
Both backends get the same weights (`load_state_dict`) and the same graph (PyG: its ``edge_index``,
GCN with ``cached=True`` as PyG's full-graph examples use it); their outputs are compared.

Per (graph, model): training epoch (forward, cross-entropy on every node, backward, Adam step) and
inference (forward without autograd): median of ``--epochs`` rounds, each a batch of back-to-back epochs
(about 5 ms of work) between CUDA events, the two backends alternating, after ``--warmup`` epochs
(datapath's first epoch checks the graph and probes its kernels).

Run:  PYTHONPATH=src:. python benchmarks/full_graph.py [--quick] [--graphs a,b] [--models gcn,gin]
Writes benchmarks/results/full_graph.json (records: graph, model, *_train_ms, *_infer_ms, speedups,
device) and full_graph.png; prints the table last.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._common import RESULTS_DIR, interleaved_ms, print_table, write_result
from datapath.nn import build_full_graph_model
from datapath.testing import SEED_GRAPHS, seed_graph


def bench(name: str, model_name: str, warmup: int, repeat: int) -> dict:
    g, spec = seed_graph(name, device="cuda")
    n = g.num_dst_nodes
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, spec.num_features, device="cuda", generator=gen)
    y = torch.randint(0, spec.num_classes, (n,), device="cuda", generator=gen)
    torch.manual_seed(0)
    ours = build_full_graph_model(model_name, spec.num_features, spec.num_classes, backend="datapath").cuda()
    theirs = build_full_graph_model(model_name, spec.num_features, spec.num_classes, backend="pyg").cuda()
    theirs.load_state_dict(ours.state_dict())
    t0 = time.perf_counter()
    ours.prepare(g)
    theirs.prepare(g)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        a, b = ours(g, x), theirs(g, x)
        diff = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
    setup_s = time.perf_counter() - t0
    rec: dict[str, Any] = {"device": torch.cuda.get_device_name(), "graph": name, "model": model_name, "nodes": n, "edges": int(g.indices.numel()),
                           "features": spec.num_features, "classes": spec.num_classes, "rel_diff": diff,
                           "setup_s": setup_s}
    train, infer = {}, {}
    for label, model in (("datapath", ours), ("pyg", theirs)):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        def train_step(model: Any = model, opt: Any = opt) -> None:
            model.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(g, x), y).backward()
            opt.step()

        def infer_step(model: Any = model) -> None:
            model.eval()
            with torch.no_grad():
                model(g, x)

        train[label], infer[label] = train_step, infer_step
    for kind, fns in (("train", train), ("infer", infer)):  # the two backends alternate (see interleaved_ms)
        for label, ms in interleaved_ms(fns, reps=repeat, target_ms=5.0, warmup=warmup).items():
            rec[f"{label}_{kind}_ms"] = ms
    rec["speedup_train"] = rec["pyg_train_ms"] / rec["datapath_train_ms"]
    rec["speedup_infer"] = rec["pyg_infer_ms"] / rec["datapath_infer_ms"]
    print(f"  {name:>16} {model_name}: train {rec['datapath_train_ms']:.3f} ms vs PyG {rec['pyg_train_ms']:.3f} "
          f"({rec['speedup_train']:.2f}x), infer {rec['datapath_infer_ms']:.3f} vs {rec['pyg_infer_ms']:.3f} "
          f"({rec['speedup_infer']:.2f}x), rel diff {diff:.1e}", flush=True)
    return rec


def plot(rows: list[dict], device: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    for ax, model in zip(axes, ("gcn", "gin")):
        rs = [r for r in rows if r["model"] == model]
        xs = range(len(rs))
        ax.bar([i - 0.2 for i in xs], [r["speedup_train"] for r in rs], 0.4, label="training epoch")
        ax.bar([i + 0.2 for i in xs], [r["speedup_infer"] for r in rs], 0.4, label="inference")
        ax.set_xticks(list(xs), [r["graph"] for r in rs], rotation=60, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{model.upper()}: datapath.nn speedup over PyG")
        ax.legend(fontsize=8)
    fig.suptitle(f"full-graph GNNs on {device}")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "full_graph.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three small graphs")
    ap.add_argument("--graphs", default=None, help=f"comma list of {sorted(SEED_GRAPHS)}")
    ap.add_argument("--models", default="gcn,gin")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/full_graph.py needs a CUDA GPU")
    names = args.graphs.split(",") if args.graphs else (
        ["citeseer", "cora", "ppi"] if args.quick else list(SEED_GRAPHS))
    device = torch.cuda.get_device_name()
    rows: list[dict] = []
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    for name in names:
        for model in args.models.split(","):
            try:
                rows.append(bench(name, model, args.warmup, args.epochs))
            except Exception as exc:  # noqa: BLE001 - report, go on with the others
                errors[f"{name}/{model}"] = f"{type(exc).__name__}: {exc}"
                print(f"  {name} {model}: FAILED {errors[f'{name}/{model}']}", flush=True)
            write_result("full_graph", {"device": device, "records": rows, "errors": errors})

    def gm(key: str, model: str) -> float:
        xs = [r[key] for r in rows if r["model"] == model]
        return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else float("nan")

    summary = {f"{m}_{k}_geomean": gm(f"speedup_{k}", m) for m in ("gcn", "gin") for k in ("train", "infer")}
    summary.update({f"{m}_{k}_min": min((r[f"speedup_{k}"] for r in rows if r["model"] == m), default=float("nan"))
                    for m in ("gcn", "gin") for k in ("train", "infer")})
    summary["bar_every_graph_ge_pyg"] = all(min(r["speedup_train"], r["speedup_infer"]) >= 1.0 for r in rows)
    path = write_result("full_graph", {"device": device, "records": rows, "summary": summary, "errors": errors,
                                       "wall_s": time.perf_counter() - t0})
    try:
        plot(rows, device)
    except Exception as exc:  # noqa: BLE001
        print(f"plot failed: {exc}")
    print(f"\nwrote {path}")
    print_table([{k: r[k] for k in ("graph", "model", "datapath_train_ms", "pyg_train_ms", "speedup_train",
                                    "datapath_infer_ms", "pyg_infer_ms", "speedup_infer")} for r in rows])
    print_table([{"metric": k, "value": v} for k, v in summary.items()])


if __name__ == "__main__":
    main()
