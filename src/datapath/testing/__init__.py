"""Helpers for tests and benchmarks of code built on datapath: random graphs shaped like real ones, and
plain-PyTorch references to check the kernels against.

    from datapath.testing import power_law_csr, reference_aggregate, seed_graph
"""
from datapath.testing.graphs import (
    SEED_GRAPHS, SeedGraph, dense_adjacency, edge_index, power_law_csr, reference_aggregate, seed_graph,
)

__all__ = [
    "SEED_GRAPHS", "SeedGraph", "dense_adjacency", "edge_index", "power_law_csr", "reference_aggregate", "seed_graph",
]
