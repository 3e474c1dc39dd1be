"""HeteroGraph: construction from PyG, per-relation CSRs, placements, files, and errors that name the type."""
from __future__ import annotations

import pytest
import torch

from datapath.graph import Graph, HeteroGraph, HeteroGraphError, InvalidGraphError


def test_relations_are_csrs_of_destination_rows(hetero) -> None:
    hg, n, eid = hetero(1)
    assert hg.node_types == list(n) and hg.edge_types == list(eid)
    for et, ei in eid.items():
        g = hg[et]
        assert isinstance(g, Graph)
        assert (g.num_src_nodes, g.num_dst_nodes, g.num_edges) == (n[et[0]], n[et[2]], ei.shape[1])
        got = sorted(map(tuple, g.edge_index().t().tolist()))
        assert got == sorted(map(tuple, ei.t().tolist()))
    assert hg.edge_type("cites") == ("paper", "cites", "paper")


def test_from_pyg_matches_heterodata(hetero) -> None:
    torch_geometric = pytest.importorskip("torch_geometric")
    hg, n, eid = hetero(2)
    data = torch_geometric.data.HeteroData()
    for t, c in n.items():
        data[t].x = torch.randn(c, 3)
    for et, ei in eid.items():
        data[et].edge_index = ei
    got = HeteroGraph.from_pyg(data)
    assert got.metadata == (list(data.node_types), [tuple(e) for e in data.edge_types])
    for et in eid:
        assert torch.equal(got[et].indptr, hg[et].indptr) and torch.equal(got[et].indices, hg[et].indices)
    got.check_features({t: data[t].x for t in n})


def test_save_load_roundtrip(hetero, tmp_path) -> None:
    hg, n, eid = hetero(3)
    back = HeteroGraph.load(hg.save(tmp_path / "hg"))
    assert back.num_nodes == hg.num_nodes and back.edge_types == hg.edge_types
    for et in eid:
        assert torch.equal(back[et].indptr, hg[et].indptr) and torch.equal(back[et].indices, hg[et].indices)
    assert back.to("cpu") is back


def test_unknown_type_is_named() -> None:
    ei = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(HeteroGraphError, match="'venue'"):
        HeteroGraph({"paper": 3}, {("venue", "hosts", "paper"): ei})
    assert issubclass(HeteroGraphError, InvalidGraphError)


def test_ids_out_of_a_types_range_are_named() -> None:
    ei = torch.tensor([[0, 5], [1, 0]])  # author 5 of 4
    with pytest.raises(HeteroGraphError, match="'author'.*4 nodes"):
        HeteroGraph({"paper": 3, "author": 4}, {("author", "writes", "paper"): ei})
    bad = Graph(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 9]), num_src_nodes=10, validate=False)
    with pytest.raises(HeteroGraphError, match="'paper'"):  # the CSR's counts disagree with the types
        HeteroGraph({"paper": 3, "author": 4}, {("author", "writes", "paper"): bad})
    bad = Graph(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 9]), num_src_nodes=4, validate=False)
    with pytest.raises(HeteroGraphError, match="writes"):
        HeteroGraph({"paper": 3, "author": 4}, {("author", "writes", "paper"): bad})


def test_mismatched_feature_tables_are_named(hetero) -> None:
    hg, n, _ = hetero(4)
    with pytest.raises(HeteroGraphError, match="'author' have 3 rows"):
        hg.check_features({"paper": torch.randn(n["paper"], 4), "author": torch.randn(3, 4)})
    with pytest.raises(HeteroGraphError, match="'venue'"):
        hg.check_features({"venue": torch.randn(2, 4)})
    with pytest.raises(HeteroGraphError, match="no relation named 'likes'"):
        hg.edge_type("likes")


@pytest.mark.gpu
def test_placements_on_gpu(hetero) -> None:
    hg, _, eid = hetero(5)
    for where in ("unified", "cuda"):
        moved = hg.to(where)
        assert moved.placement == where
        for et in eid:
            assert torch.equal(moved[et].edge_index().cpu(), hg[et].edge_index())


@pytest.mark.gpu
def test_a_relation_without_edges_moves_samples_and_trains_in_unified_memory(hetero, cuda_device) -> None:
    """0 bytes are never pinned: an empty relation once made its unified graph refuse its own arrays."""
    from datapath.nn import RGCNConv
    from datapath.sampling import HeteroNeighborSampler

    hg, n, eid = hetero(6)
    eid = dict(eid)
    eid[("fos", "unused", "paper")] = torch.empty(2, 0, dtype=torch.long)
    full = HeteroGraph(n, eid)
    for where in ("unified", "cuda"):
        moved = full.to(where)
        assert moved.placement == where and moved[("fos", "unused", "paper")].num_edges == 0
    seeds = torch.arange(0, n["paper"], 3)
    HeteroNeighborSampler([4], seed=1).sample(full.to("unified"), ("paper", seeds.to(cuda_device)))  # no error
    torch.manual_seed(0)
    conv = RGCNConv(8, 5, full.edge_types).double()
    x = {t: torch.randn(c, 8, dtype=torch.float64) for t, c in n.items()}
    ref = conv(full, x)
    got = conv.to(cuda_device)(full.to("unified").to("cuda"), {t: v.to(cuda_device) for t, v in x.items()})
    for t in ref:
        torch.testing.assert_close(got[t].cpu(), ref[t])
