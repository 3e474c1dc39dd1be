"""A PyTorch Geometric GraphSAGE trained on batches from datapath's NeighborLoader.

Your PyG model stays as it is; datapath supplies the batches: neighbours sampled on the
GPU from a graph in pinned host memory, feature rows gathered by the GPU straight from
host memory (zero copy), the next batches prepared on side streams while this one trains.
Each `Block` converts to PyG's bipartite ``edge_index`` form with ``block.to_pyg()``.

    python examples/pyg_sage.py                          # the built-in 'tiny' graph, GPU if there is one
    python examples/pyg_sage.py --dataset /data/products # a directory from `datapath prepare-dataset`
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch_geometric.nn import SAGEConv

from datapath.graph import get_dataset
from datapath.loaders import NeighborLoader
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler


class PygGraphSAGE(torch.nn.Module):
    """Plain PyG: one SAGEConv per sampled hop, input layer first."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        widths = [in_channels] + [hidden] * (num_layers - 1) + [out_channels]
        self.convs = torch.nn.ModuleList(SAGEConv(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.dropout = dropout

    def forward(self, blocks: list, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            edge_index, size = block.to_pyg()               # local ids: sources, then destinations
            x = conv((x, x[: block.num_dst_nodes]), edge_index, size=size)
            if i < len(self.convs) - 1:
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="tiny", help="preset name or prepare-dataset directory [tiny]")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--fanouts", default="10,5")
    ap.add_argument("--max-batches", type=int, default=None, help="batches per epoch at most")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    fanouts = [int(f) for f in args.fanouts.split(",")]

    ds = get_dataset(args.dataset, device="cpu" if args.dataset == "tiny" else None, progress=False)
    where = "unified" if dev.type == "cuda" else "cpu"          # pinned host memory, read by the GPU
    graph = ds.graph.to(where)
    feats, labels = to_placement(ds.features, where), to_placement(ds.labels, where)
    train = NeighborLoader(graph, ds.train_idx, NeighborSampler(fanouts, seed=0), args.batch_size, shuffle=True,
                           features=feats, labels=labels, device=dev)
    test = NeighborLoader(graph, ds.test_idx[:5000], NeighborSampler(fanouts, seed=1), 2048,
                          features=feats, labels=labels, device=dev)

    torch.manual_seed(0)
    model = PygGraphSAGE(ds.num_features, 128, ds.num_classes, len(fanouts), dropout=0.3).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        model.train()
        total, n = 0.0, 0
        for i, batch in enumerate(train):
            if args.max_batches is not None and i >= args.max_batches:
                break                                        # the loader's threads stop with the loop
            loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, n = total + float(loss), n + 1
        print(f"epoch {epoch}: mean loss {total / max(n, 1):.4f} over {n} batches")

    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for batch in test:
            correct += int((model(batch.blocks, batch.x).argmax(1) == batch.y).sum())
            seen += batch.y.numel()
    print(f"test accuracy {correct / max(seen, 1):.3f} (chance {1 / ds.num_classes:.3f})")


if __name__ == "__main__":
    main()
