"""Which rows are hot: the ranking that decides what the GPU cache and the host tier hold.

- `degree_hotness`: the nodes' in-degrees (the cache of PaGraph and DGL's default);
- `presample_hotness`: how often each node's row is read by the first layer when the actual
  sampler draws a number of batches (GNNLab's presampling), ties broken by degree.

Both return a (N,) score per row, higher = hotter; `rank` turns scores into an order.
"""
from __future__ import annotations

import torch

from datapath.graph import Graph
from datapath.memory import host_of, placement_of
from datapath.sampling import NeighborSampler

_PRESAMPLE_STEP = 1 << 40  # random streams of their own: presampling does not peek at the training batches


def degree_hotness(graph: Graph) -> torch.Tensor:
    """(N,) int64 in-degrees of ``graph`` (on the CPU; nothing is copied for a unified or cpu graph)."""
    ptr = graph.indptr if placement_of(graph.indptr) == "cuda" else host_of(graph.indptr)
    return (ptr[1:] - ptr[:-1]).long().cpu()


def presample_hotness(graph: Graph, seeds: torch.Tensor, sampler: NeighborSampler | list[int], *,
                      batch_size: int = 1024, batches: int = 64, seed: int = 0,
                      device: str | torch.device | None = None, tie_break_by_degree: bool = True) -> torch.Tensor:
    """(N,) int64 scores: how many of ``batches`` sampled batches of ``seeds`` read each node's features.

    The batches are drawn like a training epoch's (shuffled seeds, ``batch_size`` per batch)
    but from random streams of their own.  Sampling runs on ``device`` (the GPU when the graph
    is unified or cuda and CUDA is present).  With ``tie_break_by_degree`` nodes seen equally
    often are ranked by in-degree.
    """
    if not isinstance(sampler, NeighborSampler):
        sampler = NeighborSampler(sampler, seed=seed)
    if batches < 1 or batch_size < 1:
        raise ValueError(f"batches and batch_size must be >= 1, got {batches} and {batch_size}")
    if device is None:
        gpu = torch.cuda.is_available() and graph.placement in ("unified", "cuda")
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    device = torch.device(device)
    seeds = torch.as_tensor(seeds).to("cpu", torch.int64)
    order = seeds[torch.randperm(seeds.numel(), generator=torch.Generator().manual_seed(seed + 7919))]
    counts = torch.zeros(graph.num_nodes, dtype=torch.int64, device=device)
    for i in range(min(batches, -(-order.numel() // batch_size))):
        part = order[i * batch_size:(i + 1) * batch_size].to(device)
        blocks = sampler.sample(graph, part, step=_PRESAMPLE_STEP + i)
        counts[blocks[0].src_nodes] += 1  # a block's source ids are distinct
    counts = counts.cpu()
    if tie_break_by_degree:
        deg = degree_hotness(graph)
        counts = counts * (int(deg.max()) + 1 if deg.numel() else 1) + deg
    return counts


def rank(scores: torch.Tensor) -> torch.Tensor:
    """(N,) int64 row ids, hottest first (ties in row order)."""
    scores = torch.as_tensor(scores)
    if scores.dim() != 1:
        raise ValueError(f"hotness scores must be 1-D (one per row), got shape {tuple(scores.shape)}")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.argsort(scores.to(dev), descending=True, stable=True).cpu()
