"""Random graphs and float64 references for tests and benchmarks of the aggregation ops and layers.

    from datapath.testing.graphs import power_law_csr, reference_aggregate, seed_graph
    g = power_law_csr(120, 150, 900, seed=0)               # a CSRGraph with hubs, duplicates, empty rows
    ref = reference_aggregate(g, x.double(), "mean")        # (num_dst, F) float64, differentiable
    g, spec = seed_graph("amazon0505", device="cuda")       # shaped like a dataset of the seed papers
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from datapath.graph import CSRGraph


def power_law_csr(num_dst: int, num_src: int, num_edges: int, *, alpha: float = 1.2, zero_rows: float = 0.05,
                  self_loops: bool = True, index_dtype: torch.dtype = torch.int64, seed: int = 0,
                  device: str | torch.device = "cpu", src_alpha: float | None = None) -> CSRGraph:
    """A CSR of ``num_dst`` rows over ``num_src`` sources with about ``num_edges`` edges.

    Row lengths (Zipf exponent ``alpha / 2``) and source popularity (``src_alpha``, default
    ``alpha``) follow power laws, so a few rows are very long, sources repeat within rows
    (duplicate edges), a ``zero_rows`` fraction of rows is empty and unpopular sources get no
    edge (isolated).  With ``self_loops`` every 7th non-empty row ``d < num_src`` gets the edge
    ``d -> d``.  Node ids carry no locality (random order).
    """
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_dst + 1, dtype=torch.float64)
    share = ranks.pow(-alpha / 2)  # milder skew on row lengths than on popularity
    share = share[torch.randperm(num_dst, generator=g)]
    share[torch.rand(num_dst, generator=g) < zero_rows] = 0.0
    if num_dst and share.sum() == 0:
        share[0] = 1.0
    deg = torch.floor(share / share.sum().clamp(min=1e-300) * num_edges
                      + torch.rand(num_dst, generator=g, dtype=torch.float64)).to(torch.int64)
    loop_rows = torch.arange(0, min(num_dst, num_src), 7)
    if self_loops:
        deg[loop_rows] += 1
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    e = int(indptr[-1])
    if e and num_src:
        pop = torch.arange(1, num_src + 1, dtype=torch.float64).pow(-(alpha if src_alpha is None else src_alpha))
        perm = torch.randperm(num_src, generator=g)
        indices = perm[torch.multinomial(pop, e, replacement=True, generator=g)]
    else:
        indices = torch.empty(0, dtype=torch.int64)
    if self_loops and e:
        last = indptr[1:][loop_rows] - 1  # the last slot of each loop row
        keep = deg[loop_rows] > 0
        indices[last[keep]] = loop_rows[keep]
    return CSRGraph(indptr.to(device), indices.to(index_dtype).to(device), num_src, num_dst)


def edge_index(graph: CSRGraph) -> torch.Tensor:
    """(2, E) int64 ``[src, dst]`` of ``graph``'s edges in CSR order, on its device: PyG's ``edge_index``."""
    ip = graph.indptr
    dst = torch.repeat_interleave(torch.arange(graph.num_dst_nodes, device=ip.device), ip[1:] - ip[:-1],
                                  output_size=graph.indices.numel())
    return torch.stack([graph.indices.long(), dst])


def dense_adjacency(graph: CSRGraph, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(num_dst, num_src) float64 matrix on the CPU; duplicate edges summed; ``weight`` (E,) per CSR position."""
    ip, ix = graph.indptr.cpu(), graph.indices.cpu().long()
    rows = torch.repeat_interleave(torch.arange(graph.num_dst_nodes), ip[1:] - ip[:-1])
    w = torch.ones(ix.numel(), dtype=torch.float64) if weight is None else weight.cpu().to(torch.float64)
    a = torch.zeros(graph.num_dst_nodes, graph.num_src_nodes, dtype=torch.float64)
    return a.index_put((rows, ix), w, accumulate=True)


def reference_aggregate(graph: CSRGraph, x: torch.Tensor, reduce: str = "sum", weight: torch.Tensor | None = None,
                        norm: str | None = None) -> torch.Tensor:
    """What `datapath.ops.aggregate` computes, in float64 on the CPU with dense matrices and loops.

    ``x`` (num_src, F) float64 (autograd-capable in ``x`` and ``weight``); ``reduce`` sum/mean/max,
    ``norm`` None or ``"gcn"``; empty rows give 0.
    """
    ip, ix = graph.indptr.cpu(), graph.indices.cpu().long()
    deg_in = (ip[1:] - ip[:-1]).clamp(min=1).to(torch.float64)
    if reduce == "max":
        rows = []
        for d in range(graph.num_dst_nodes):
            lo, hi = int(ip[d]), int(ip[d + 1])
            if lo == hi:
                rows.append(torch.zeros(x.shape[1], dtype=torch.float64))
                continue
            msg = x[ix[lo:hi]]
            if weight is not None:
                msg = msg * weight[lo:hi, None]
            rows.append(msg.max(0).values)
        return torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=torch.float64)
    a = dense_adjacency(graph) if weight is None else None
    if weight is not None:  # differentiable in the weight
        rows_ = torch.repeat_interleave(torch.arange(graph.num_dst_nodes), ip[1:] - ip[:-1])
        a = torch.zeros(graph.num_dst_nodes, graph.num_src_nodes, dtype=torch.float64)
        a = a.index_put((rows_, ix), weight.to(torch.float64), accumulate=True)
    if norm == "gcn":
        deg_out = torch.bincount(ix, minlength=graph.num_src_nodes).clamp(min=1).to(torch.float64)
        a = a / deg_in.sqrt()[:, None] / deg_out.sqrt()[None, :]
    out = a @ x
    if reduce == "mean":
        out = out / deg_in[:, None]
    return out


@dataclass(frozen=True)
class SeedGraph:
    """A dataset of the seed papers (GNNAdvisor / TC-GNN tables): size, feature width, classes."""

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int


SEED_GRAPHS: dict[str, SeedGraph] = {s.name: s for s in (
    # GNNAdvisor / TC-GNN Type I
    SeedGraph("citeseer", 3_327, 9_464, 3_703, 6),
    SeedGraph("cora", 2_708, 10_858, 1_433, 7),
    SeedGraph("pubmed", 19_717, 88_676, 500, 3),
    SeedGraph("ppi", 56_944, 818_716, 50, 121),
    # Type II
    SeedGraph("PROTEINS_full", 43_471, 162_088, 29, 2),
    SeedGraph("OVCAR-8H", 1_890_931, 3_946_402, 66, 2),
    SeedGraph("Yeast", 1_714_644, 3_636_546, 74, 2),
    # Type III
    SeedGraph("amazon0505", 410_236, 4_878_875, 96, 22),
    SeedGraph("artist", 50_515, 1_638_396, 100, 12),
    SeedGraph("com-amazon", 334_863, 1_851_744, 96, 22),
    SeedGraph("soc-BlogCatalog", 88_784, 2_093_195, 128, 39),
)}


def seed_graph(name: str, *, device: str | torch.device = "cpu", seed: int = 0,
               index_dtype: torch.dtype = torch.int32) -> tuple[CSRGraph, SeedGraph]:
    """A symmetric graph shaped like seed dataset ``name`` (nodes, directed edge count), with communities.

    Generated by `datapath.graph.generate` (a degree-corrected planted partition: power-law
    degrees, 70% of edges inside one of ``num_classes`` communities, no duplicates or self
    loops), so it has community structure for reordering to find; node ids are in random
    order, as in a crawled graph.  Returns ``(graph, spec)``; features are not generated.
    """
    from datapath.graph import SyntheticSpec, generate  # noqa: PLC0415

    s = SEED_GRAPHS[name]
    spec = SyntheticSpec(name, s.num_nodes, s.num_edges // 2, 1, max(2, s.num_classes), seed=seed)
    ds = generate(spec, device=device, progress=False)
    g = ds.graph
    return CSRGraph(g.indptr.to(device), g.indices.to(index_dtype).to(device), g.num_src_nodes,
                    g.num_dst_nodes), s
