"""Random power-law CSR graphs for the tests and the aggregation benchmark (not public API)."""
from __future__ import annotations

import torch

from datapath.ops._graph import CSRGraph


def power_law_csr(num_dst: int, num_src: int, num_edges: int, *, alpha: float = 1.2, zero_rows: float = 0.05,
                  self_loops: bool = True, index_dtype: torch.dtype = torch.int64, seed: int = 0,
                  device: str | torch.device = "cpu", src_alpha: float | None = None) -> CSRGraph:
    """A CSR of ``num_dst`` rows over ``num_src`` sources with about ``num_edges`` edges.

    Row lengths (Zipf exponent ``alpha / 2``) and source popularity (``src_alpha``, default
    ``alpha``) follow power laws, so a
    few rows are very long, sources repeat within rows (duplicate edges), a ``zero_rows``
    fraction of rows is empty and unpopular sources get no edge (isolated).  With
    ``self_loops`` every 7th non-empty row ``d < num_src`` gets the edge ``d -> d``.
    """
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_dst + 1, dtype=torch.float64)
    share = ranks.pow(-alpha / 2)  # milder skew on row lengths than on popularity
    share = share[torch.randperm(num_dst, generator=g)]
    share[torch.rand(num_dst, generator=g) < zero_rows] = 0.0
    if share.sum() == 0:
        share[0] = 1.0
    deg = torch.floor(share / share.sum() * num_edges + torch.rand(num_dst, generator=g, dtype=torch.float64))
    deg = deg.to(torch.int64)
    if self_loops:
        loop_rows = torch.arange(0, min(num_dst, num_src), 7)
        deg[loop_rows] += 1
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    e = int(indptr[-1])
    pop = torch.arange(1, num_src + 1, dtype=torch.float64).pow(-(alpha if src_alpha is None else src_alpha))
    perm = torch.randperm(num_src, generator=g)
    indices = perm[torch.multinomial(pop, e, replacement=True, generator=g)] if e else torch.empty(0, dtype=torch.int64)
    if self_loops and e:
        last = indptr[1:][loop_rows] - 1  # the last slot of each loop row
        keep = deg[loop_rows] > 0
        indices[last[keep]] = loop_rows[keep]
    return CSRGraph(indptr.to(device), indices.to(index_dtype).to(device), num_src, num_dst)
