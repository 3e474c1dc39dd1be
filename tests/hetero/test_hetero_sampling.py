"""HeteroNeighborSampler: typed blocks whose edges are the graph's, fanouts per relation, CPU == GPU."""
from __future__ import annotations

import pytest
import torch

from datapath.sampling import HeteroBlock, HeteroNeighborSampler, SamplingError


def _edge_set(hg, et) -> set[tuple[int, int]]:
    return set(map(tuple, hg[et].edge_index().t().tolist()))


def _check_blocks(hg, blocks: list[HeteroBlock], seeds: dict, fan: dict) -> None:
    assert {t: blocks[-1].dst_nodes(t).tolist() for t in seeds} == {t: s.tolist() for t, s in seeds.items()}
    for lower, upper in zip(blocks[:-1], blocks[1:]):  # a layer's inputs are the next layer's outputs
        for t in hg.node_types:
            assert torch.equal(lower.dst_nodes(t), upper.src_nodes[t])
    for hop, b in enumerate(reversed(blocks)):
        for t, src in b.src_nodes.items():
            assert src.unique().numel() == src.numel()
        for et, r in b.relations.items():
            s, d = et[0], et[2]
            assert r.num_src_nodes == b.src_nodes[s].numel() and r.num_dst_nodes == b.num_dst_nodes[d]
            ei = b.to_pyg()[et]
            glob = torch.stack([b.src_nodes[s][ei[0]], b.src_nodes[d][ei[1]]])
            edges = _edge_set(hg, et)
            pairs = list(map(tuple, glob.t().tolist()))
            assert set(pairs) <= edges
            assert len(set(pairs)) == len(pairs)  # without replacement: each sampled edge once (no multi-edges here)
            full = hg[et].in_degrees()[b.dst_nodes(d)]
            k = fan[et][hop]
            assert torch.equal(r.in_degrees(), full.clamp(max=k))


def test_blocks_hold_the_graphs_edges(hetero) -> None:
    hg, n, eid = hetero(7, scale=3)
    # no parallel edges, so that a sampled edge set can be compared exactly
    from datapath.graph import HeteroGraph
    hg = HeteroGraph(n, {et: torch.unique(ei, dim=1) for et, ei in eid.items()})
    fan = {et: [3, 2] for et in hg.edge_types}
    fan[("paper", "cites", "paper")] = [4, 1]
    sampler = HeteroNeighborSampler({**{et: v for et, v in fan.items() if et[1] != "cites"}, "cites": [4, 1]}, seed=3)
    seeds = {"paper": torch.tensor([0, 5, 17, 33]), "author": torch.tensor([2, 9])}
    blocks = sampler.sample(hg, seeds, step=1)
    assert len(blocks) == 2
    _check_blocks(hg, blocks, seeds, fan)
    again = sampler.sample(hg, seeds, step=1)
    for a, b in zip(blocks, again):
        assert all(torch.equal(a.src_nodes[t], b.src_nodes[t]) for t in a.src_nodes)
    other = sampler.sample(hg, seeds, step=2)  # another step draws other neighbours somewhere
    assert any(a.src_nodes[t].tolist() != b.src_nodes[t].tolist() for a, b in zip(blocks, other) for t in a.src_nodes)


def test_all_neighbours_and_errors(hetero) -> None:
    hg, _, _ = hetero(8)
    blocks = HeteroNeighborSampler([-1]).sample(hg, ("paper", torch.arange(10)))
    for et, r in blocks[0].relations.items():
        assert torch.equal(r.in_degrees(), hg[et].in_degrees()[:10])
    with pytest.raises(SamplingError, match="venue"):
        HeteroNeighborSampler([2]).sample(hg, ("venue", torch.arange(3)))
    with pytest.raises(SamplingError, match="'author'"):
        HeteroNeighborSampler([2]).sample(hg, ("author", torch.tensor([0, 40])))
    with pytest.raises(SamplingError, match="relations"):
        HeteroNeighborSampler({"cites": [2]}).sample(hg, ("paper", torch.arange(3)))
    with pytest.raises(SamplingError, match="likes"):
        HeteroNeighborSampler({"likes": [2]}).sample(hg, ("paper", torch.arange(3)))
    with pytest.raises(SamplingError, match="same number of hops"):
        HeteroNeighborSampler({"cites": [2], "topic": [2, 3]})


@pytest.mark.gpu
def test_gpu_matches_cpu(hetero, cuda_device) -> None:
    hg, _, _ = hetero(9, scale=20)
    sampler = HeteroNeighborSampler([5, 3, 2], seed=11)
    seeds = torch.randperm(hg.num_nodes["paper"])[:64]
    cpu = sampler.sample(hg, ("paper", seeds), step=4)
    gpu = sampler.sample(hg.to("unified"), ("paper", seeds.to(cuda_device)), step=4)
    for a, b in zip(cpu, gpu):
        for t in a.src_nodes:
            assert torch.equal(a.src_nodes[t], b.src_nodes[t].cpu())
        for et in a.relations:
            assert torch.equal(a.relations[et].indptr, b.relations[et].indptr.cpu())
            assert torch.equal(a.relations[et].indices, b.relations[et].indices.cpu())
