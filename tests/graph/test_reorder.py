"""`datapath.graph.reorder`: a permutation that renumbers the graph without changing what it computes."""
from __future__ import annotations

import pytest
import torch

from datapath.graph import CSRGraph, Graph
from datapath.graph import REORDER_METHODS as METHODS, reorder, window_locality
from datapath.ops import aggregate
from datapath.testing import power_law_csr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _symmetric(n: int, m: int, seed: int, device: str = "cpu") -> Graph:
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, n, (2, m), generator=g)
    keep = src != dst
    ei = torch.stack([torch.cat([src[keep], dst[keep]]), torch.cat([dst[keep], src[keep]])])
    return Graph.from_edge_index(ei.to(device), n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_reorder_is_a_relabelling(method: str, device: str) -> None:
    g = _symmetric(500, 1500, seed=1, device=device)
    new, perm = reorder(g, method)
    assert isinstance(new, Graph) and new.num_edges == g.num_edges
    assert torch.equal(torch.sort(perm).values.cpu(), torch.arange(500))
    x = torch.randn(500, 7, dtype=torch.float64, device=device)
    for reduce in ("sum", "mean", "max"):
        torch.testing.assert_close(aggregate(new, x[perm], reduce), aggregate(g, x, reduce)[perm])
    ip = new.indptr.cpu()
    idx = new.indices.cpu()
    for r in range(0, 500, 37):  # neighbours listed in ascending new id
        row = idx[ip[r]:ip[r + 1]]
        assert torch.equal(row, torch.sort(row).values)


@pytest.mark.slow
def test_rcm_narrows_the_bandwidth_of_a_shuffled_band() -> None:
    n = 2000
    i = torch.arange(n - 3)
    src = torch.cat([i, i + 1, i, i + 3])
    dst = torch.cat([i + 1, i, i + 3, i])
    shuffle = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    g = Graph.from_edge_index(torch.stack([shuffle[src], shuffle[dst]]), n)

    def bandwidth(gr: Graph) -> int:
        ei = gr.edge_index()
        return int((ei[0] - ei[1]).abs().max())
    new, _ = reorder(g, "rcm")
    assert bandwidth(g) > 500 and bandwidth(new) <= 6
    assert window_locality(new)["reuse"] > window_locality(g)["reuse"]


def test_degree_order_and_community_grouping() -> None:
    g = power_law_csr(300, 300, 3000, seed=2, self_loops=False)
    sym = Graph.from_edge_index(torch.cat([torch.stack([g.indices, torch.repeat_interleave(
        torch.arange(300), g.indptr[1:] - g.indptr[:-1])]), torch.stack([torch.repeat_interleave(
            torch.arange(300), g.indptr[1:] - g.indptr[:-1]), g.indices])], 1), 300)
    new, perm = reorder(sym, "degree")
    deg = new.in_degrees()
    assert bool((deg[:-1] >= deg[1:]).all())
    # two dense communities joined by one edge, ids interleaved: the community order separates them
    a, b = torch.arange(0, 200, 2), torch.arange(1, 200, 2)
    e = [torch.combinations(c, 2).T for c in (a, b)] + [torch.tensor([[0], [1]])]
    ei = torch.cat(e, 1)
    two = Graph.from_edge_index(torch.cat([ei, ei.flip(0)], 1), 200)
    new, perm = reorder(two, "community")
    side = perm % 2
    assert int((side[1:] != side[:-1]).sum()) == 1  # one switch between the communities


def test_reorder_rejects_bad_input() -> None:
    g = power_law_csr(10, 12, 30)
    with pytest.raises(ValueError, match="square"):
        reorder(g, "rcm")
    with pytest.raises(ValueError, match="method"):
        reorder(CSRGraph(g.indptr, g.indices.clamp(max=9), 10, 10), "random")
