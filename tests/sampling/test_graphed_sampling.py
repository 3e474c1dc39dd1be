"""GPU sampling replayed from a captured CUDA graph (``NeighborSampler(cuda_graphs=True)``, the default): blocks
bit-identical to the kernels launched one by one and to the CPU sampler, on random graphs, fanouts and batch
sizes; blocks of earlier batches left intact by later replays; the loader's batches unchanged, with dropout
drawn in the training thread while producer threads sample (a capture there made the dropout fail)."""
from __future__ import annotations

import random

import pytest
import torch

from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler

pytestmark = pytest.mark.gpu

_FIELDS = ("indptr", "indices", "src_nodes", "edge_ids")


def _graph(rng: random.Random) -> Graph:
    """A random graph: 1..4000 nodes, hubs and isolated nodes, int32 or int64 CSR, edge ids or not."""
    n = rng.randint(1, 4000)
    e = rng.randint(0, 40 * n)
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    dst = (torch.rand(e, generator=g) ** rng.choice([1, 3]) * n).long().clamp(max=n - 1)
    src = torch.randint(0, n, (e,), generator=g)
    base = Graph.from_edge_index(torch.stack([src, dst]), n)
    ptr = base.indptr.to(rng.choice([torch.int32, torch.int64]))
    idx = base.indices.to(rng.choice([torch.int32, torch.int64]))
    eids = torch.randperm(base.num_edges, generator=g) if rng.random() < 0.5 else None
    return Graph(ptr, idx, edge_ids=eids)


def _same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.num_dst_nodes == y.num_dst_nodes and x.max_degree == y.max_degree, what
        for name in _FIELDS:
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), (what, name)
            if u is not None:
                assert torch.equal(u.cpu(), v.cpu()), (what, name)


@pytest.mark.parametrize("seed", range(6))
def test_graphed_sampling_equals_the_launches_and_the_cpu_on_random_shapes(cuda_device, seed: int) -> None:
    """Per case: a random graph in unified or cuda memory, 1-3 hops of random fanouts (-1 too), with or without
    replacement and edge ids, batches of random sizes, smaller ones replayed on a graph captured for a larger
    batch; every batch's blocks equal the one-by-one launches' and the CPU's, and the first batch's blocks are
    compared again after all the later replays."""
    rng = random.Random(seed)
    for case in range(8):
        graph = _graph(rng)
        replace = rng.random() < 0.3
        fanouts = [rng.choice([1, 2, 5, 10, 17] + ([] if replace else [-1])) for _ in range(rng.randint(1, 3))]
        kw = dict(replace=replace, seed=rng.getrandbits(20), return_edge_ids=rng.random() < 0.5,
                  blocks_per_sm=rng.choice([1, 8, 32]))
        graphed, launched = NeighborSampler(fanouts, **kw), NeighborSampler(fanouts, cuda_graphs=False, **kw)
        placed = graph.to(rng.choice(["unified", "cuda"]))
        big = rng.randint(1, graph.num_nodes)
        assert graphed.capture_cuda_graphs(placed, [big], cuda_device)
        kept = []
        for step in range(4):
            b = big if step == 0 else rng.randint(max(1, big // 2), big)  # the last, smaller batch reuses it
            seeds = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(step))[:b]
            got = graphed.sample(placed, seeds.to(cuda_device), step=step)
            what = f"seed {seed} case {case} step {step}: {graph.num_nodes} nodes, fanouts {fanouts}, {kw}, b {b}"
            _same(got, launched.sample(placed, seeds.to(cuda_device), step=step), what + " (launches)")
            cpu = launched.sample(graph, seeds, step=step)
            _same(got, cpu, what + " (cpu)")
            kept.append((got, cpu, what))
        torch.cuda.synchronize()
        for got, cpu, what in kept:  # later replays overwrote the graph's buffers, not these blocks
            _same(got, cpu, what + " (after later replays)")


def test_graphed_sampling_cuts_host_time(cuda_device) -> None:
    """The point of the graph: a 3-hop sample of 512 seeds queues in far less host time than its launches."""
    import time  # noqa: PLC0415

    graph = _graph(random.Random(5)).to("unified")
    seeds = torch.randperm(graph.num_nodes)[:512].to(cuda_device)

    def host_ms(sampler: NeighborSampler) -> float:
        sampler.capture_cuda_graphs(graph, [512], cuda_device)
        for step in range(3):
            sampler._launch(graph, seeds, step).blocks()
        t0 = time.thread_time()
        for step in range(20):
            sampler._launch(graph, seeds, step).blocks()
        return (time.thread_time() - t0) / 20 * 1e3

    launched = host_ms(NeighborSampler([15, 10, 5], cuda_graphs=False))
    graphed = host_ms(NeighborSampler([15, 10, 5]))
    assert graphed < 0.5 * launched, (graphed, launched)
    assert not NeighborSampler([15, 10, 5], cuda_graphs=False).capture_cuda_graphs(graph, [512], cuda_device)


def test_a_graph_captured_under_other_settings_is_not_replayed(cuda_device) -> None:
    """The settings are public attributes: changed after the capture, the launches (not the old graph) run."""
    graph = _graph(random.Random(7)).to("unified")
    seeds = torch.randperm(graph.num_nodes)[:64].to(cuda_device)
    sampler = NeighborSampler([4, 3], seed=3)
    assert sampler.capture_cuda_graphs(graph, [64], cuda_device)
    sampler.return_edge_ids = True
    got = sampler.sample(graph, seeds, step=2)
    assert all(b.edge_ids is not None for b in got)
    _same(got, NeighborSampler([4, 3], seed=3, return_edge_ids=True, cuda_graphs=False).sample(graph, seeds, step=2),
          "settings changed")


def test_loader_batches_are_the_same_with_graphed_sampling(cuda_device) -> None:
    """The prefetching loader (captured as the epoch begins, replayed by two producer threads on their own
    streams) gives the same batches."""
    graph = _graph(random.Random(11))
    while graph.num_nodes < 600:
        graph = _graph(random.Random(graph.num_nodes + 12))
    feats = torch.randn(graph.num_nodes, 8)
    unified = graph.to("unified")
    batches = {}
    for graphs in (True, False):
        loader = NeighborLoader(unified, torch.arange(graph.num_nodes), NeighborSampler([6, 4], cuda_graphs=graphs),
                                batch_size=128, shuffle=True, features=to_placement(feats, "unified"), device=cuda_device,
                                num_workers=2, prefetch=2)
        got = []
        for b in loader:  # the training thread draws dropout masks while the producers sample
            torch.nn.functional.dropout(torch.ones(4096, device=cuda_device), 0.5)
            got.append((b.seeds.cpu(), b.x.cpu(), b.blocks))
        batches[graphs] = got
        loader.close()
    assert len(batches[True]) == len(batches[False]) == -(-graph.num_nodes // 128)
    for (s1, x1, b1), (s2, x2, b2) in zip(batches[True], batches[False]):
        assert torch.equal(s1, s2) and torch.equal(x1, x2)
        _same(b1, b2, "loader")
