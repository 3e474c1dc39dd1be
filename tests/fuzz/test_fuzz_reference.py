"""The fuzz's float64 references agree with PyTorch Geometric's layers where the two define the same function."""
from __future__ import annotations

import random

import pytest
import torch

from datapath import nn as dnn
from datapath.testing import fuzz_reference as ref
from datapath.testing.fuzz_graphs import GRAPH_KINDS, edge_lists, fuzz_graph

pyg = pytest.importorskip("torch_geometric.nn")


def _graph(seed: int) -> tuple:
    g, _ = fuzz_graph(random.Random(seed), "power_law", "cpu")
    src, dst = edge_lists(g)
    return g, src, dst, torch.stack([src, dst])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("aggr", ["mean", "sum", "max"])
def test_sage_reference_is_pygs_sage(seed: int, aggr: str) -> None:
    g, src, dst, ei = _graph(seed)
    torch.manual_seed(seed)
    conv = dnn.SAGEConv(12, 5, aggr=aggr).double()
    theirs = pyg.SAGEConv(12, 5, aggr=aggr).double()
    theirs.load_state_dict(conv.state_dict())
    x = torch.randn(g.num_src_nodes, 12, dtype=torch.float64)
    n = g.num_dst_nodes
    want = theirs((x, x[:n]), ei, size=(g.num_src_nodes, n))
    torch.testing.assert_close(ref.sage(src, dst, n, x, x[:n], conv), want)


@pytest.mark.parametrize("seed", range(4))
def test_gin_and_gat_references_are_pygs(seed: int) -> None:
    g, src, dst, ei = _graph(seed)
    n = g.num_dst_nodes
    x = torch.randn(g.num_src_nodes, 9, dtype=torch.float64)
    torch.manual_seed(seed)
    gin = dnn.GINConv(torch.nn.Linear(9, 4), eps=0.3).double()
    theirs = pyg.GINConv(torch.nn.Linear(9, 4), eps=0.3).double()
    theirs.load_state_dict(gin.state_dict())
    torch.testing.assert_close(ref.gin(src, dst, n, x, x[:n], gin), theirs((x, x[:n]), ei, size=(x.shape[0], n)))
    gat = dnn.GATConv(9, 3, heads=2).double()
    theirs_gat = pyg.GATConv(9, 3, heads=2, add_self_loops=False).double()
    theirs_gat.load_state_dict(gat.state_dict(), strict=False)
    with torch.no_grad():
        theirs_gat.lin.weight.copy_(gat.lin.weight)
    want = theirs_gat((x, x[:n]), ei, size=(x.shape[0], n))
    torch.testing.assert_close(ref.gat(src, dst, n, x, x[:n], gat, paired=False), want)


def test_every_graph_kind_is_made_and_valid() -> None:
    rng = random.Random(0)
    for kind in GRAPH_KINDS:
        for _ in range(3):
            g, info = fuzz_graph(rng, kind, "cpu")
            ip, ix = g.indptr.long(), g.indices.long()
            assert info["kind"] == kind and int(ip[0]) == 0 and int(ip[-1]) == ix.numel()
            assert bool((ip[1:] >= ip[:-1]).all())
            assert ix.numel() == 0 or (int(ix.min()) >= 0 and int(ix.max()) < g.num_src_nodes)
    g, info = fuzz_graph(random.Random(3), "huge_row", "cpu")
    assert int((g.indptr[1:] - g.indptr[:-1]).max()) >= info["huge_row"]
    g, info = fuzz_graph(random.Random(4), "block", "cpu")
    assert g.num_src_nodes >= g.num_dst_nodes
