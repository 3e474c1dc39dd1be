"""datapath.testing's graph helpers agree with each other and with the CSR they describe."""
from __future__ import annotations

import torch

from datapath.testing import dense_adjacency, edge_index, power_law_csr


def test_edge_index_lists_every_csr_edge_as_src_dst() -> None:
    g = power_law_csr(300, 200, 4000, seed=3)
    ei = edge_index(g)
    assert ei.shape == (2, g.indices.numel()) and ei.dtype == torch.int64
    assert torch.equal(ei[0], g.indices.long())  # CSR order kept
    a = torch.zeros(g.num_dst_nodes, g.num_src_nodes, dtype=torch.float64)
    a.index_put_((ei[1], ei[0]), torch.ones(ei.shape[1], dtype=torch.float64), accumulate=True)
    assert torch.equal(a, dense_adjacency(g))
