"""Random graphs for the differential fuzz (`datapath.testing.fuzz`): every shape the ops must survive.

    rng = random.Random(7)
    g, info = fuzz_graph(rng, "huge_row", "cuda", scale="gpu")   # info: {"kind": ..., "nodes": ..., ...}

Kinds (`GRAPH_KINDS`): ``power_law`` (hubs, duplicate edges, self loops, empty rows, isolated
sources), ``uniform`` (`Graph.from_edge_index` of random edges), ``empty_rows`` (most rows
empty), ``one_node`` (a single node, maybe with self loops), ``no_edges``, ``huge_row``
(one destination with 100K edges at ``scale="gpu"``, 4K on the CPU), ``reordered``
(`Graph.reorder` by a random method), ``block`` (a block straight from `NeighborLoader`:
``num_src != num_dst``, trusted, sampled on the GPU from a unified graph on CUDA), and
``bipartite`` (a CSR of ``num_dst`` rows over ``num_src`` sources, either larger).
Everything is drawn from ``rng`` alone, so a case is reproduced by its seed.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from datapath.graph import CSRGraph, Graph
from datapath.testing.graphs import power_law_csr

GRAPH_KINDS = ("power_law", "uniform", "empty_rows", "one_node", "no_edges", "huge_row", "reordered", "block",
               "bipartite")
"""Every graph kind `fuzz_graph` makes."""
SQUARE_KINDS = tuple(k for k in GRAPH_KINDS if k != "bipartite")
"""Kinds whose destinations are the first sources (``num_dst <= num_src``): what the layers take."""

HUGE_ROW = {"gpu": 100_000, "cpu": 4_000}
"""Edges of the one long row of a ``huge_row`` graph, by scale."""
MAX_NODES = {"gpu": 5_000, "cpu": 400}
MAX_EDGES = {"gpu": 60_000, "cpu": 3_000}


def _nodes(rng: random.Random, scale: str) -> int:
    return max(2, int(round(2 ** rng.uniform(1, MAX_NODES[scale].bit_length() - 1))))


def _edges(rng: random.Random, nodes: int, scale: str, edge_budget: int) -> int:
    hi = max(1, min(MAX_EDGES[scale], edge_budget, nodes * rng.choice((1, 2, 4, 12, 30))))
    return rng.randint(0, hi)


def _generator(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.getrandbits(62))


def _index_dtype(rng: random.Random) -> torch.dtype:
    return rng.choice((torch.int32, torch.int64))


def _from_edges(src: torch.Tensor, dst: torch.Tensor, nodes: int, rng: random.Random) -> Graph:
    g = Graph.from_edge_index(torch.stack([src, dst]), nodes)
    if rng.random() < 0.5:  # int64 indices too (from_edge_index picks int32 for small graphs)
        g = Graph(g.indptr, g.indices.long(), num_src_nodes=g.num_src_nodes, validate=False)
    return g


def fuzz_graph(rng: random.Random, kind: str, device: str | torch.device, *, scale: str = "cpu",
               edge_budget: int = 1 << 30) -> tuple[Any, dict[str, Any]]:
    """A random graph of ``kind`` on ``device`` and a dict describing it (kind, nodes, edges, ...).

    ``scale``: ``"cpu"`` (at most a few hundred nodes and thousands of edges) or ``"gpu"`` (thousands
    of nodes, tens of thousands of edges, the 100K-edge row).  ``edge_budget`` caps the edge count
    (the callers keep edges x width bounded so that the float64 reference stays cheap).
    The graph is a `datapath.graph.Graph`, `datapath.graph.CSRGraph` or `datapath.sampling.Block`.
    """
    if kind not in GRAPH_KINDS:
        raise ValueError(f"kind must be one of {GRAPH_KINDS}, got {kind!r}")
    if scale not in MAX_NODES:
        raise ValueError(f"scale must be 'cpu' or 'gpu', got {scale!r}")
    dev = torch.device(device)
    gen = _generator(rng)
    info: dict[str, Any] = {"kind": kind}
    if kind == "power_law":
        n_dst, n_src = _nodes(rng, scale), _nodes(rng, scale)
        n_src = max(n_src, n_dst)
        e = _edges(rng, n_dst, scale, edge_budget)
        g = power_law_csr(n_dst, n_src, e, alpha=rng.uniform(0.6, 2.2), zero_rows=rng.choice((0.0, 0.05, 0.3)),
                          self_loops=rng.random() < 0.7, index_dtype=_index_dtype(rng), seed=rng.getrandbits(31),
                          device=dev)
    elif kind == "bipartite":
        n_dst, n_src = _nodes(rng, scale), _nodes(rng, scale)
        e = _edges(rng, n_dst, scale, edge_budget)
        g = power_law_csr(n_dst, n_src, e, alpha=rng.uniform(0.6, 2.0), zero_rows=0.1, self_loops=False,
                          index_dtype=_index_dtype(rng), seed=rng.getrandbits(31), device=dev)
    elif kind in ("uniform", "reordered"):
        n = _nodes(rng, scale)
        e = _edges(rng, n, scale, edge_budget)
        src = torch.randint(0, n, (e,), generator=gen)
        dst = torch.randint(0, n, (e,), generator=gen)
        g = _from_edges(src, dst, n, rng).to("cuda" if dev.type == "cuda" else "cpu")
        if kind == "reordered":
            method = rng.choice(("degree", "rcm", "community"))
            g, _ = g.reorder(method)
            info["method"] = method
    elif kind == "empty_rows":
        n = _nodes(rng, scale)
        rows = max(1, n // rng.choice((10, 50, 1000)))
        e = _edges(rng, rows, scale, edge_budget)
        dst = torch.randperm(n, generator=gen)[:rows][torch.randint(0, rows, (e,), generator=gen)]
        src = torch.randint(0, n, (e,), generator=gen)
        g = _from_edges(src, dst, n, rng).to("cuda" if dev.type == "cuda" else "cpu")
    elif kind == "one_node":
        loops = rng.choice((0, 1, 3))
        g = CSRGraph(torch.tensor([0, loops], device=dev), torch.zeros(loops, dtype=_index_dtype(rng), device=dev),
                     1, 1)
    elif kind == "no_edges":
        n_dst = rng.choice((0, 1, _nodes(rng, scale)))
        n_src = max(n_dst, rng.choice((0, 1, _nodes(rng, scale))))
        g = CSRGraph(torch.zeros(n_dst + 1, dtype=torch.int64, device=dev),
                     torch.zeros(0, dtype=_index_dtype(rng), device=dev), n_src, n_dst)
    elif kind == "huge_row":
        n = _nodes(rng, scale)
        big = min(HUGE_ROW[scale], edge_budget) if rng.random() < 0.7 else rng.randint(1, HUGE_ROW[scale])
        small = _edges(rng, n, scale, edge_budget)
        hub = rng.randrange(n)
        src = torch.cat([torch.randint(0, n, (big,), generator=gen), torch.randint(0, n, (small,), generator=gen)])
        dst = torch.cat([torch.full((big,), hub, dtype=torch.int64), torch.randint(0, n, (small,), generator=gen)])
        g = _from_edges(src, dst, n, rng).to("cuda" if dev.type == "cuda" else "cpu")
        info["huge_row"] = big
    else:  # block
        g, binfo = _loader_block(rng, dev, scale, edge_budget)
        info.update(binfo)
    info.update(nodes_src=int(g.num_src_nodes), nodes_dst=int(g.num_dst_nodes), edges=int(g.indices.numel()))
    return g, info


def _loader_block(rng: random.Random, dev: torch.device, scale: str, edge_budget: int) -> tuple[Any, dict[str, Any]]:
    """One block of a `NeighborLoader` batch over a random power-law graph (the hop picked at random)."""
    from datapath.loaders import NeighborLoader  # noqa: PLC0415 - loaders sit above testing's graphs

    n = max(8, _nodes(rng, scale))
    e = _edges(rng, n, scale, edge_budget)
    base = power_law_csr(n, n, e, alpha=rng.uniform(0.8, 2.0), zero_rows=0.05, seed=rng.getrandbits(31))
    graph = Graph(base.indptr, base.indices, num_src_nodes=n, validate=False)
    on_gpu = dev.type == "cuda"
    if on_gpu:
        graph = graph.to(rng.choice(("unified", "cuda")))
    hops = rng.randint(1, 3)
    fanouts = [rng.choice((-1, 1, 2, 3, 5, 10, 11, 25)) for _ in range(hops)]
    batch = rng.randint(1, max(1, min(n, 400)))
    seeds = torch.randperm(n, generator=_generator(rng))[:batch]
    loader = NeighborLoader(graph, seeds, fanouts, batch_size=batch, device="cuda" if on_gpu else "cpu",
                            seed=rng.getrandbits(31), prefetch=0)
    it = iter(loader)
    blocks = next(it).blocks
    del it
    loader.close()
    hop = rng.randrange(len(blocks))
    block = blocks[hop]
    if on_gpu and block.device.type != "cuda":
        block = block.to("cuda")
    return block, {"fanouts": fanouts, "hop": hop, "seeds": batch, "base_nodes": n, "base_edges": e,
                   "sampled_on": "cuda" if on_gpu else "cpu"}


def edge_lists(graph: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` int64 CPU tensors of ``graph``'s edges in CSR order (for the float64 references)."""
    from datapath.memory import host_of, placement_of  # noqa: PLC0415

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return (host_of(t) if placement_of(t) == "unified" else t).cpu().long()

    ip, ix = cpu(graph.indptr), cpu(graph.indices)
    num_dst = ip.numel() - 1
    dst = torch.repeat_interleave(torch.arange(num_dst), ip[1:] - ip[:-1], output_size=ix.numel())
    return ix, dst
