"""Helpers for tests and benchmarks of code built on datapath: random graphs shaped like real ones, plain-PyTorch
references to check the kernels against, and a differential fuzz of every op and layer.

    from datapath.testing import power_law_csr, reference_aggregate, seed_graph
    from datapath.testing import run_fuzz                       # seeded random cases vs float64 references
    bad = [r for r in run_fuzz(seed=0, count=300, device="cuda") if not r.ok]
    print(bad[0].reproduction())                                # python source re-running that case alone
    from datapath.testing import run_offload_fuzz               # random models under offloading: bit-identical
"""
from datapath.testing.fuzz import OPS as FUZZ_OPS
from datapath.testing.fuzz import CaseResult, FuzzCase, make_case, run_case, run_fuzz
from datapath.testing.fuzz_graphs import GRAPH_KINDS, fuzz_graph
from datapath.testing.fuzz_offload import (
    OffloadCase, OffloadCaseResult, make_offload_case, run_offload_case, run_offload_fuzz,
)
from datapath.testing.graphs import (
    SEED_GRAPHS, SeedGraph, dense_adjacency, edge_index, power_law_csr, reference_aggregate, seed_graph,
)

__all__ = [
    "FUZZ_OPS", "GRAPH_KINDS", "SEED_GRAPHS", "CaseResult", "FuzzCase", "OffloadCase", "OffloadCaseResult", "SeedGraph",
    "dense_adjacency", "edge_index", "fuzz_graph", "make_case", "make_offload_case", "power_law_csr",
    "reference_aggregate", "run_case", "run_fuzz", "run_offload_case", "run_offload_fuzz", "seed_graph",
]
