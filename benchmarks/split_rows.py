"""How many input rows a rank's part of a global batch reads: a floor under data-parallel strong scaling.

With the global batch of one GPU cut over N ranks, each rank samples its part and gathers the features of its
part's input nodes (the first block's sources).  Those rows, not the seeds, set a rank's PCIe reads and its first
layer's work, and they shrink more slowly than the seeds: the parts share neighbours that each now reads on its
own.  For each global batch size this samples ``--batches`` batches whole (GraphSAGE fanouts, as B2 and
``multi_gpu.py``: every node's neighbours are drawn from the batch's random stream, so a part samples what the
whole batch samples for its nodes) and cut three ways, reporting the largest part's rows over the whole batch's:

- ``random``: the seeds as they come (a shuffled order), cut in equal parts: what ``DistributedNeighborLoader``
  does;
- ``community``: the batch's seeds sorted by their position in `datapath.graph.reorder`'s ``"community"`` order
  (label-propagation communities) before the cut, so a rank's seeds share neighbourhoods;
- ``planted``: sorted by the synthetic generator's own communities (the node labels): the best a partition
  could find on these graphs.

A part's share of the rows is a floor for what a rank gathers and projects in its first layer against one GPU,
however fast the exchange or the host work (its sampled edges, and the work on them, halve exactly): a strong
epoch at 0.55x the 1-GPU one on two ranks needs the rows to stop setting a step's time (features on the GPU).

    PYTHONPATH=src:. python benchmarks/split_rows.py                   # products shape, 1024 and 4096 (~5 min CPU)
    PYTHONPATH=src:. python benchmarks/split_rows.py --quick           # 1/20 of products (~20 s)
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks._common import bars_by_batch, finish
from benchmarks.gnn_epoch import dataset_spec
from datapath.graph import generate, reorder
from datapath.sampling import NeighborSampler

SPLITS = ("random", "community", "planted")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="products")
    p.add_argument("--quick", action="store_true", help="1/20 of the dataset's nodes and edges")
    p.add_argument("--batch-sizes", default="1024,4096", help="global batch sizes")
    p.add_argument("--ranks", type=int, default=2, help="parts a global batch is cut into [2]")
    p.add_argument("--batches", type=int, default=5, help="global batches measured per size [5]")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="split_rows")
    a = p.parse_args()
    if a.ranks < 2:
        p.error(f"--ranks must be at least 2, got {a.ranks}")
    a.papers_feature_gb = 40.0
    return a


def rows(sampler: NeighborSampler, graph: Any, seeds: torch.Tensor, step: int) -> int:
    """Input rows (distinct first-block sources) of ``seeds``' sample from batch ``step``'s random stream."""
    return int(sampler.sample(graph, seeds, step=step)[0].num_src_nodes)


def measure(ds: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    graph = ds.graph
    _, perm = reorder(graph, "community")
    position = torch.empty_like(perm)
    position[perm] = torch.arange(perm.numel())
    keys = {"community": position, "planted": ds.labels.long()}
    sampler = NeighborSampler([int(f) for f in a.fanouts.split(",")], seed=a.seed)
    order = ds.train_idx[torch.randperm(ds.train_idx.numel(), generator=torch.Generator().manual_seed(a.seed))]
    out = []
    for bs in (int(s) for s in a.batch_sizes.split(",")):
        if bs * a.batches > order.numel():
            raise SystemExit(f"{a.batches} batches of {bs} need {bs * a.batches} training nodes; "
                             f"the dataset has {order.numel()}")
        whole: list[int] = []
        parts: dict[str, list[int]] = {s: [] for s in SPLITS}
        for i in range(a.batches):
            batch = order[i * bs:(i + 1) * bs]
            whole.append(rows(sampler, graph, batch, i))
            for split in SPLITS:
                cut = batch if split == "random" else batch[torch.argsort(keys[split][batch], stable=True)]
                parts[split].append(max(rows(sampler, graph, p, i) for p in cut.tensor_split(a.ranks)))
        full = statistics.mean(whole)
        for split in SPLITS:
            part = statistics.mean(parts[split])
            out.append({"dataset": ds.name, "batch_size": bs, "ranks": a.ranks, "split": split,
                        "rows_batch": full, "rows_rank": part, "rank_share": part / full,
                        "seed_share": 1 / a.ranks, "batches": a.batches, "fanouts": a.fanouts})
    return out


def plot(records: list[dict[str, Any]], path: Any) -> None:
    bars_by_batch(records, "split", SPLITS, "rank_share", path, "a rank's input rows / the batch's",
                  f"{records[0]['dataset']}: {records[0]['ranks']} ranks, global batches",
                  hline=(records[0]["seed_share"], "seeds' share"))


def main() -> None:
    a = parse()
    ds = generate(dataset_spec(a.dataset, a), device="cpu", progress=False)
    records = measure(ds, a)
    finish(a.name, __doc__.split("\n\n")[0], records,
           ["batch_size", "ranks", "split", "rows_batch", "rows_rank", "rank_share"], a, plot)


if __name__ == "__main__":
    main()
