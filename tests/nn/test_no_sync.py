"""No layer of datapath.nn synchronises with the host in its forward or backward pass (CUDA).

Run under ``torch.cuda.set_sync_debug_mode("error")``, which turns any synchronising torch call
into an error.  A sampled block (``trusted``) is never waited for, not even on its first call; a
whole graph is checked (and its kernels probed) on its first call, then never again.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from datapath.graph import CSRGraph
from datapath.nn import GAT, GCN, GIN, GATConv, GCNConv, GINConv, GraphSAGE, SAGEConv
from datapath.testing import power_law_csr

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


LAYERS = {
    "sage_mean": lambda: SAGEConv(24, 16),
    "sage_project_first": lambda: SAGEConv(24, 8),
    "sage_sum_normalize": lambda: SAGEConv(24, 32, aggr="sum", normalize=True),
    "sage_max": lambda: SAGEConv(24, 16, aggr="max"),
    "gcn": lambda: GCNConv(24, 16),
    "gcn_self_loops": lambda: GCNConv(24, 16, add_self_loops=True),
    "gin_linear": lambda: GINConv(nn.Linear(24, 8), train_eps=True),
    "gin_mlp": lambda: GINConv(nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 8))),
    "gin_mean": lambda: GINConv(nn.Linear(24, 24), aggr="mean"),
    "gat": lambda: GATConv(24, 8, heads=3),
    "gat_mean_dropout": lambda: GATConv(24, 8, heads=2, concat=False, dropout=0.3),
}


def _step(layer: nn.Module, g: CSRGraph, x: torch.Tensor, w: torch.Tensor | None = None) -> None:
    out = layer(g, x) if w is None else layer(g, x, edge_weight=w)
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_on_a_block_never_waits(kind: str) -> None:
    torch.manual_seed(0)
    g = power_law_csr(400, 900, 5000, seed=1, device="cuda")
    block = CSRGraph(g.indptr, g.indices, g.num_src_nodes, g.num_dst_nodes, trusted=True)
    layer = LAYERS[kind]().cuda().train()
    x = torch.randn(block.num_src_nodes, 24, device="cuda", requires_grad=True)
    with no_sync():
        _step(layer, block, x)  # the first call on a new block: schedules built without waiting
        _step(layer, block, x)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_on_a_whole_graph_waits_only_on_its_first_call(kind: str) -> None:
    torch.manual_seed(0)
    g = power_law_csr(30_000, 30_000, 300_000, seed=2, index_dtype=torch.int32, device="cuda")
    layer = LAYERS[kind]().cuda().train()
    x = torch.randn(g.num_src_nodes, 24, device="cuda", requires_grad=True)
    _step(layer, g, x)  # checks the graph, probes the kernels
    with no_sync():
        _step(layer, g, x)
        _step(layer, g, x)


def test_weighted_layers_never_wait() -> None:
    g = power_law_csr(400, 900, 5000, seed=3, device="cuda")
    block = CSRGraph(g.indptr, g.indices, g.num_src_nodes, g.num_dst_nodes, trusted=True)
    w = torch.rand(block.indices.numel(), device="cuda", requires_grad=True)
    x = torch.randn(block.num_src_nodes, 24, device="cuda", requires_grad=True)
    layers = [layer.cuda() for layer in (SAGEConv(24, 16), GCNConv(24, 16), GINConv(nn.Linear(24, 8)))]
    with no_sync():
        for layer in layers:
            _step(layer, block, x, w)


def test_models_never_wait() -> None:
    torch.manual_seed(1)
    g = power_law_csr(20_000, 20_000, 200_000, seed=4, index_dtype=torch.int32, device="cuda")
    x = torch.randn(g.num_src_nodes, 40, device="cuda")
    for model in (GCN(40, 16, 5), GIN(40, 64, 5)):
        model = model.cuda().train()
        model.prepare(g)
        model(g, x).sum().backward()  # the first call checks and probes
        with no_sync():
            model(g, x).sum().backward()
    blocks = [power_law_csr(n_dst, n_src, e, seed=5 + i, device="cuda") for i, (n_dst, n_src, e) in
              enumerate(((2000, 6000, 20000), (500, 2000, 6000), (100, 500, 1500)))]
    blocks = [CSRGraph(b.indptr, b.indices, b.num_src_nodes, b.num_dst_nodes, trusted=True) for b in blocks]
    xb = torch.randn(6000, 40, device="cuda")
    for model in (GraphSAGE(40, 32, 5, num_layers=3), GAT(40, 32, 5, num_layers=3)):
        model = model.cuda().train()
        with no_sync():
            model(blocks, xb).sum().backward()
