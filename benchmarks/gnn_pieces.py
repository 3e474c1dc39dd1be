"""Where a mini-batch's time goes: the loader and the training step, each on its own and together.

B2's setup (GraphSAGE, 3 layers, fanouts 15/10/5, hidden 256, dropout 0.5, fused Adam; the loader
builds the aggregation schedules, ``prepare=model.prepare_batch``) on the products shape, graph and
features unified (``--placement cuda``: GPU-resident).  For each batch size, in one process, the pieces
take turns over ``--repeats`` rounds of ``--batches`` batches each (per piece: the median, smallest and
largest ms a batch of its rounds, and the process's CPU ms a batch, every thread):

- ``loader``: the loader alone (its producer thread, as B2 and ``train-gnn`` run it);
- ``loader_serial``: the same batches made one at a time in the calling thread (``prefetch=0``);
- ``step``: the training step alone, on batches made before it (forward, cross-entropy, backward, Adam);
- ``loop``: both, a bare loop over the loader;
- ``train_epoch``: both with `datapath.apps.train_epoch`'s bookkeeping (what ``train-gnn`` runs).

A piece whose time does not fall with the batch and whose CPU time equals its wall time is host-bound:
its launches and Python, not the GPU, set its pace.  ``loop`` against the larger of ``loader`` and
``step`` is what the two threads lose to each other.  Issue 39 (strong scaling) needs a rank's step at half
the batch to take about half the time; this shows which piece does not.

    PYTHONPATH=src:. python benchmarks/gnn_pieces.py                       # products, 512 and 1024 seeds
    PYTHONPATH=src:. python benchmarks/gnn_pieces.py --quick --device cpu  # 1/20 of products on the CPU (~1 min)
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._common import bars_by_batch, finish
from benchmarks.gnn_epoch import dataset_spec
from datapath.apps import train_epoch
from datapath.graph import Graph, generate
from datapath.loaders import NeighborLoader
from datapath.nn.models import build_model
from datapath.sampling import NeighborSampler
from datapath.unified_tensor import as_unified

PIECES = ("loader", "loader_serial", "step", "loop", "train_epoch")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="products")
    p.add_argument("--quick", action="store_true", help="1/20 of the dataset's nodes and edges, fewer batches")
    p.add_argument("--batch-sizes", default="512,1024")
    p.add_argument("--batches", type=int, default=None, help="batches a round [120; quick 10]")
    p.add_argument("--repeats", type=int, default=None, help="rounds of each piece [5; quick 2]")
    p.add_argument("--placement", choices=("unified", "cuda"), default="unified",
                   help="where the graph and features live on a GPU machine [unified]")
    p.add_argument("--device", default=None, help="cuda or cpu [cuda when available]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="gnn_pieces")
    a = p.parse_args()
    a.papers_feature_gb = 40.0
    a.batches = a.batches or (10 if a.quick else 120)
    a.repeats = a.repeats or (2 if a.quick else 5)
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return a


def placed(ds: Any, a: argparse.Namespace) -> tuple[Graph, torch.Tensor, torch.Tensor]:
    if a.device.type != "cuda":
        return ds.graph, ds.features, ds.labels
    if a.placement == "cuda":
        return ds.graph.to("cuda"), ds.features.cuda(), ds.labels.cuda()
    g = ds.graph  # pinned in place, as B2's datapath way
    return (Graph(as_unified(g.indptr), as_unified(g.indices), validate=False), as_unified(ds.features),
            as_unified(ds.labels))


def measure(fn: Callable[[], None], batches: int, cuda: bool) -> tuple[float, float]:
    """(wall ms, process CPU ms) a batch of ``fn()``, which runs ``batches`` batches."""
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / batches * 1e3, (time.process_time() - c0) / batches * 1e3


def pieces(ds: Any, bs: int, a: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Every piece's (ms, CPU ms) a batch in each of ``a.repeats`` rounds, the pieces taking turns."""
    graph, feats, labels = placed(ds, a)
    torch.manual_seed(a.seed)
    model = build_model("sage", ds.num_features, 256, ds.num_classes, 3, dropout=0.5).to(a.device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, fused=a.device.type == "cuda")
    n = a.batches

    def loader(prefetch: int) -> NeighborLoader:
        return NeighborLoader(graph, ds.train_idx, NeighborSampler([15, 10, 5], seed=a.seed), bs, shuffle=True,
                              features=feats, labels=labels, device=a.device, prefetch=prefetch,
                              prepare=model.prepare_batch)

    threaded, serial = loader(1), loader(0)
    if len(threaded) < n:
        raise SystemExit(f"{len(threaded)} batches of {bs} in an epoch: pass --batches {len(threaded)} or fewer")

    def step(b: Any) -> None:
        loss = F.cross_entropy(model(b.blocks, b.x), b.y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def iterate(ld: NeighborLoader, train: bool) -> None:
        it = iter(ld)
        for _ in range(n):
            b = next(it)
            if train:
                step(b)
        close = getattr(it, "close", None)
        if close is not None:
            close()

    made: list[Any] = []

    def steps_only() -> None:
        for b in made:
            step(b)

    run = {"loader": lambda: iterate(threaded, False), "loader_serial": lambda: iterate(serial, False),
           "step": steps_only, "loop": lambda: iterate(threaded, True),
           "train_epoch": lambda: train_epoch(model, threaded, opt, max_batches=n)}
    train_epoch(model, threaded, opt, max_batches=min(n, 20))  # warm-up: kernels, allocator, graphs captured
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in PIECES}
    cuda = a.device.type == "cuda"
    for _ in range(a.repeats):
        it = iter(serial)
        made[:] = [next(it) for _ in range(n)]  # the step's batches, made before it is timed
        for k in PIECES:
            out[k].append(measure(run[k], n, cuda))
        made.clear()
    return out


def plot(records: list[dict[str, Any]], path: Any) -> None:
    bars_by_batch(records, "piece", PIECES, "ms_per_batch", path, "ms a batch (median)",
                  f"{records[0]['dataset']}: {records[0]['device']}")


def main() -> None:
    a = parse()
    ds = generate(dataset_spec(a.dataset, a), progress=False)
    device = torch.cuda.get_device_name(a.device) if a.device.type == "cuda" else "cpu"
    records = []
    for bs in (int(s) for s in a.batch_sizes.split(",")):
        for piece, runs in pieces(ds, bs, a).items():
            ms = [w for w, _ in runs]
            records.append({"dataset": ds.name, "batch_size": bs, "placement": a.placement if a.device.type == "cuda"
                            else "cpu", "piece": piece, "ms_per_batch": statistics.median(ms), "ms_min": min(ms),
                            "ms_max": max(ms), "cpu_ms_per_batch": statistics.median(c for _, c in runs),
                            "device": device, "batches": a.batches, "rounds": len(runs)})
    finish(a.name, __doc__.split("\n\n")[0], records,
           ["batch_size", "piece", "ms_per_batch", "ms_min", "ms_max", "cpu_ms_per_batch"], a, plot)


if __name__ == "__main__":
    main()
