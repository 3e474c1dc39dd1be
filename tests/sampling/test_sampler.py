"""NeighborSampler: correctness against a plain reference, statistics, reproducibility, CPU == GPU."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from datapath.graph import Graph
from datapath.sampling import NeighborSampler, SamplingError, relabel, relabel_dense


def _random_graph(n: int, e: int, seed: int, idx_dtype=torch.int32, ptr_dtype=torch.int64) -> Graph:
    g = torch.Generator().manual_seed(seed)
    # power-law-ish: a few hubs get many in-edges, many nodes have degree < fanout
    dst = (torch.rand(e, generator=g) ** 3 * n).long()
    src = torch.randint(0, n, (e,), generator=g)
    base = Graph.from_edge_index(torch.stack([src, dst]), n)
    return Graph(base.indptr.to(ptr_dtype), base.indices.to(idx_dtype))


def _check_blocks(graph: Graph, seeds: torch.Tensor, blocks, fanouts, replace=False) -> None:
    """Every block against the graph: real edges, counts, no repeats, DGL's dst-first rule, chaining."""
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu().long()
    assert len(blocks) == len(fanouts)
    assert torch.equal(blocks[-1].dst_nodes.cpu(), seeds.cpu())
    for layer, block in enumerate(blocks):
        k = fanouts[len(fanouts) - 1 - layer]
        src = block.src_nodes.cpu()
        assert src.unique().numel() == src.numel(), "source nodes must be distinct"
        bptr, bidx = block.indptr.cpu(), block.indices.cpu()
        assert bptr[0] == 0 and bptr[-1] == bidx.numel() and bptr.numel() == block.num_dst_nodes + 1
        # the block's row-length bound (the ops plan by it unchecked): the fanout, and it holds
        assert block.trusted and block.max_degree is not None and (k == -1 or block.max_degree == k)
        assert block.num_edges == 0 or int((bptr[1:] - bptr[:-1]).max()) <= block.max_degree
        assert bidx.numel() == 0 or (bidx.min() >= 0 and bidx.max() < block.num_src_nodes)
        if layer > 0:
            assert torch.equal(blocks[layer - 1].dst_nodes.cpu(), src), "blocks must chain"
        for i in range(block.num_dst_nodes):
            v = int(src[i])
            row = indices[indptr[v]:indptr[v + 1]]
            d = row.numel()
            got = src[bidx[bptr[i]:bptr[i + 1]]]
            if replace:
                assert got.numel() == (k if d else 0)
                assert set(got.tolist()) <= set(row.tolist())
            else:
                assert got.numel() == min(d, k)
                # no repeats: as a multiset, the sample is contained in the neighbour list
                have = np.bincount(got.numpy(), minlength=graph.num_nodes)
                allowed = np.bincount(row.numpy(), minlength=graph.num_nodes)
                assert (have <= allowed).all()
                if d <= k:
                    assert got.tolist() == row.tolist(), "degree <= fanout keeps all neighbours in order"


@pytest.mark.parametrize("replace", [False, True])
def test_cpu_blocks_are_valid_samples(replace: bool) -> None:
    graph = _random_graph(400, 6000, 0)
    seeds = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:64]
    fanouts = [6, 3, 2]
    blocks = NeighborSampler(fanouts, replace=replace, seed=7).sample(graph, seeds)
    _check_blocks(graph, seeds, blocks, fanouts, replace)


def test_all_neighbours_fanout_and_edge_ids() -> None:
    graph = _random_graph(200, 3000, 2)
    graph = Graph(graph.indptr, graph.indices, edge_ids=torch.randperm(graph.num_edges) + 10_000)
    seeds = torch.arange(0, 200, 3)
    blocks = NeighborSampler([-1, 4], return_edge_ids=True).sample(graph, seeds)
    last = blocks[-1]
    deg = graph.in_degrees()[seeds]
    assert torch.equal(last.in_degrees(), deg)
    for b in blocks:  # edge ids name the sampled edges
        e = b.edge_ids
        assert e.numel() == b.num_edges
        pos = torch.argsort(graph.edge_ids)[e - 10_000]  # CSR position of each edge id
        assert torch.equal(graph.indices[pos].long(), b.src_nodes[b.indices])


def test_reproducible_and_step_dependent() -> None:
    graph = _random_graph(500, 8000, 3)
    seeds = torch.arange(0, 500, 5)
    s = NeighborSampler([8, 4], seed=3)
    a, b = s.sample(graph, seeds, step=11), NeighborSampler([8, 4], seed=3).sample(graph, seeds, step=11)
    for x, y in zip(a, b):
        assert torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indices, y.indices)
    c = s.sample(graph, seeds, step=12)
    assert not torch.equal(a[0].src_nodes, c[0].src_nodes)
    d = NeighborSampler([8, 4], seed=4).sample(graph, seeds, step=11)
    assert not torch.equal(a[0].src_nodes, d[0].src_nodes)


def _star_graph(copies: int, degree: int) -> Graph:
    """Nodes 0..copies-1 each have the same in-neighbours copies..copies+degree-1."""
    indptr = torch.cat([torch.arange(copies + 1) * degree, torch.full((degree,), copies * degree)])
    indices = (torch.arange(degree) + copies).repeat(copies).int()
    return Graph(indptr, indices)


def _star_samples(device: str, copies: int, degree: int, k: int, replace: bool) -> np.ndarray:
    """(copies, k) neighbour offsets sampled for the star nodes (one independent draw each)."""
    graph = _star_graph(copies, degree)
    seeds = torch.arange(copies)
    if device == "cuda":
        graph, seeds = graph.to("unified"), seeds.cuda()
    (block,) = NeighborSampler([k], replace=replace, seed=123).sample(graph, seeds)
    got = block.src_nodes[block.indices].cpu() - copies
    assert torch.equal(block.in_degrees().cpu(), torch.full((copies,), k))
    return got.view(copies, k).numpy()


def _chi2_uniform_subsets(samples: np.ndarray, degree: int, k: int) -> None:
    copies = samples.shape[0]
    for row in samples[:200]:
        assert len(set(row.tolist())) == k, "no repeats without replacement"
    # each neighbour with probability k/degree
    counts = np.bincount(samples.ravel(), minlength=degree)
    p_single = stats.chisquare(counts, np.full(degree, copies * k / degree)).pvalue
    # each pair with probability k(k-1) / (degree(degree-1)): catches non-uniform subsets
    pairs = {p: i for i, p in enumerate(itertools.combinations(range(degree), 2))}
    pc = np.zeros(len(pairs))
    for row in np.sort(samples, axis=1):
        for p in itertools.combinations(row.tolist(), 2):
            pc[pairs[p]] += 1
    p_pair = stats.chisquare(pc, np.full(len(pairs), pc.sum() / len(pairs))).pvalue
    assert p_single > 1e-4 and p_pair > 1e-4, (p_single, p_pair)


def _chi2_with_replacement(samples: np.ndarray, degree: int) -> None:
    counts = np.bincount(samples.ravel(), minlength=degree)
    assert stats.chisquare(counts, np.full(degree, samples.size / degree)).pvalue > 1e-4
    # draws within a row are independent: repeats occur as often as they should
    rows_with_repeat = np.mean([len(set(r.tolist())) < r.size for r in samples])
    k = samples.shape[1]
    expect = 1 - np.prod([(degree - i) / degree for i in range(k)])
    assert abs(rows_with_repeat - expect) < 0.05


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_statistics_without_replacement(device: str) -> None:
    degree, k = 12, 4
    _chi2_uniform_subsets(_star_samples(device, 6000, degree, k, False), degree, k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_statistics_with_replacement(device: str) -> None:
    degree, k = 10, 5
    _chi2_with_replacement(_star_samples(device, 6000, degree, k, True), degree)


def test_fanout_larger_than_degree_keeps_all() -> None:
    (block,) = NeighborSampler([5]).sample(_star_graph(50, 3), torch.arange(50))
    got = (block.src_nodes[block.indices] - 50).view(50, 3)
    assert (got == torch.arange(3)).all()


def test_relabel_matches_dense_and_first_occurrence() -> None:
    g = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 300, (4000,), generator=g)
    valid = torch.rand(4000, generator=g) < 0.8
    local, unique, count = relabel(keys, valid)
    kv = keys[valid]
    first_seen = list(dict.fromkeys(kv.tolist()))
    assert unique[: int(count)].tolist() == first_seen
    assert torch.equal(unique[local[valid]], kv)
    l2, u2 = relabel_dense(kv.numpy(), np.full(300, -1, dtype=np.int64))
    assert np.array_equal(l2, local[valid].numpy()) and u2.tolist() == first_seen


def test_bad_arguments() -> None:
    graph = _random_graph(50, 200, 6)
    with pytest.raises(SamplingError, match="fanouts"):
        NeighborSampler([0])
    with pytest.raises(SamplingError, match="seed ids"):
        NeighborSampler([2]).sample(graph, torch.tensor([0, 50]))
    with pytest.raises(SamplingError, match="int32 or int64"):
        NeighborSampler([2]).sample(graph, torch.tensor([0.0]))
    with pytest.raises(SamplingError, match="replace"):
        NeighborSampler([-1], replace=True).sample(graph, torch.tensor([1]))


@pytest.mark.gpu
@pytest.mark.parametrize("ptr_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("where", ["unified", "cuda"])
@pytest.mark.parametrize("replace", [False, True])
def test_gpu_equals_cpu(cuda_device, ptr_dtype, idx_dtype, where, replace) -> None:
    graph = _random_graph(3000, 60000, 7, idx_dtype, ptr_dtype)
    graph = Graph(graph.indptr, graph.indices, edge_ids=torch.randperm(graph.num_edges))
    seeds = torch.randperm(3000, generator=torch.Generator().manual_seed(8))[:256]
    s = NeighborSampler([10, 5, 3], replace=replace, seed=9, return_edge_ids=True)
    cpu = s.sample(graph, seeds, step=4)
    gpu = s.sample(graph.to(where), seeds.to(cuda_device), step=4)
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda" and b.num_dst_nodes == a.num_dst_nodes and b.max_degree == a.max_degree
        assert b.to("cpu").max_degree == b.max_degree
        for name in ("indptr", "indices", "src_nodes", "edge_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
    _check_blocks(graph, seeds, cpu, s.fanouts, replace)


@pytest.mark.gpu
def test_gpu_rejects_pageable_graph(cuda_device) -> None:
    graph = _random_graph(100, 500, 9)
    with pytest.raises(SamplingError, match="unified"):
        NeighborSampler([3]).sample(graph, torch.arange(4, device=cuda_device))
