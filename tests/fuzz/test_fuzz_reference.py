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


def test_the_reference_sums_are_accurately_rounded_where_index_add_is_not() -> None:
    """Equal terms onto a large partial sum (a hub's ``gy / deg`` down a source's column): float64 ``index_add``
    drifts by hundreds of u, `ref.scatter_sum` stays within 1 u of the exact (rational) sum, forward and backward."""
    from fractions import Fraction

    n = 3_000
    index = torch.zeros(n + 2, dtype=torch.int64)
    index[-1] = 1
    f64 = torch.float64
    terms = torch.cat([torch.tensor([2.7], dtype=f64), torch.full((n,), 0.8 / 97_291, dtype=f64),
                       torch.tensor([-1.5], dtype=f64)])
    exact = float(Fraction(2.7) + n * Fraction(0.8 / 97_291))
    plain = torch.zeros(2, dtype=torch.float64).index_add(0, index, terms)
    ours = ref.scatter_sum(index, terms, 2)
    u = 2.0**-53
    assert abs(float(plain[0]) - exact) > 50 * u * exact
    assert abs(float(ours[0]) - exact) <= u * exact and float(ours[1]) == -1.5
    x = torch.tensor([[0.8 / 97_291]], dtype=torch.float64, requires_grad=True)
    ref.scatter_sum(torch.zeros(n, dtype=torch.int64), ref.gather(x, torch.zeros(n, dtype=torch.int64)), 1).backward(
        torch.ones(1, 1, dtype=torch.float64))
    assert float(x.grad) == n  # the gather's backward sums n ones exactly
    rows = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(0))
    vals = torch.randn(500, 3, dtype=torch.float64)
    torch.testing.assert_close(ref.scatter_sum(rows, vals, 7), torch.zeros(7, 3, dtype=torch.float64).index_add(
        0, rows, vals), rtol=0, atol=1e-13)


def test_a_max_sends_the_whole_gradient_to_one_copy_of_a_repeated_source() -> None:
    """A row of 3,000 duplicate edges from the source holding its max: that source's gradient is exactly ``gy``
    (torch's amax splits it 3,000 ways and sums it back, off by hundreds of u)."""
    src = torch.tensor([0, 1] * 3_000)
    dst = torch.zeros(6_000, dtype=torch.int64)
    x = torch.tensor([[2.0], [1.0]], dtype=torch.float64, requires_grad=True)
    gy = torch.tensor([[0.7]], dtype=torch.float64)
    out = ref.aggregate(src, dst, 1, x, "max")
    assert float(out.detach()) == 2.0
    out.backward(gy)
    assert x.grad.tolist() == [[0.7], [0.0]]


def test_gat_kinks_flag_a_score_at_leaky_relus_kink() -> None:
    torch.manual_seed(0)
    gat = dnn.GATConv(4, 2, heads=1).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    src, dst = torch.tensor([1, 2]), torch.tensor([0, 1])
    with torch.no_grad():
        h = x @ gat.lin.weight.t()
        a_src, a_dst = (h * gat.att_src[0]).sum(-1), (h * gat.att_dst[0]).sum(-1)
        gat.att_src.mul_(-a_dst[0] / a_src[1])  # edge 1 -> 0 scores exactly 0; edge 2 -> 1 generally not
    kinks = ref.gat_kinks(src, dst, 3, x, x, gat, paired=False, u=2.0**-11)
    assert kinks.tolist() == [True, False, False]
