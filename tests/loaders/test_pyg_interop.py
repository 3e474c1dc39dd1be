"""Blocks in PyG's edge_index form: torch_geometric layers compute and train on our batches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from datapath.graph import generate
from datapath.loaders import NeighborLoader
from datapath.sampling import NeighborSampler

pyg_nn = pytest.importorskip("torch_geometric.nn")


def test_edge_index_direction_and_sizes() -> None:
    ds = generate("tiny", device="cpu", progress=False)
    batch = next(iter(NeighborLoader(ds.graph, ds.train_idx, NeighborSampler([4, 3]), 64,
                                     features=ds.features, labels=ds.labels, device="cpu")))
    block = batch.blocks[0]
    edge_index, size = block.to_pyg()
    assert size == (block.num_src_nodes, block.num_dst_nodes) and edge_index.shape == (2, block.num_edges)
    # PyG SAGEConv with lin_r off and lin_l = identity is the mean over each destination's sampled sources
    conv = pyg_nn.SAGEConv(ds.num_features, ds.num_features, root_weight=False, bias=False)
    with torch.no_grad():
        conv.lin_l.weight.copy_(torch.eye(ds.num_features))
    out = conv((batch.x, batch.x[: block.num_dst_nodes]), edge_index, size=size)
    ref = torch.zeros(block.num_dst_nodes, ds.num_features)
    for i in range(block.num_dst_nodes):
        srcs = block.src_nodes[block.indices[block.indptr[i]:block.indptr[i + 1]]]  # global ids
        if srcs.numel():
            ref[i] = ds.features[srcs].mean(0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class PygSage(torch.nn.Module):
    """A plain PyG GraphSAGE consuming our batches, as a user would write it."""

    def __init__(self, f: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList([pyg_nn.SAGEConv(f, hidden), pyg_nn.SAGEConv(hidden, classes)])

    def forward(self, blocks, x):
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            edge_index, size = block.to_pyg()
            x = conv((x, x[: block.num_dst_nodes]), edge_index, size=size)
            x = F.relu(x) if i == 0 else x
        return x


def test_pyg_model_trains_on_our_batches() -> None:
    ds = generate("tiny", device="cpu", progress=False)
    torch.manual_seed(0)
    model = PygSage(ds.num_features, 64, ds.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    loader = NeighborLoader(ds.graph, ds.train_idx, [10, 5], 512, shuffle=True, features=ds.features,
                            labels=ds.labels, device="cpu")
    for _ in range(2):
        for b in loader:
            loss = F.cross_entropy(model(b.blocks, b.x), b.y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    val = NeighborLoader(ds.graph, ds.val_idx, [10, 5], 2048, features=ds.features, labels=ds.labels, device="cpu")
    with torch.no_grad():
        acc = sum((model(b.blocks, b.x).argmax(1) == b.y).sum().item() for b in val) / ds.val_idx.numel()
    assert acc > 0.5  # chance is 1/8
