"""GNN aggregation ops: neighbor aggregation (SpMM), SDDMM and edge softmax, with autograd.

On CUDA the aggregation runs the kernel planned for the graph (a row-split kernel, GNNAdvisor's
neighbor groups, a TC-GNN tensor-core kernel for float16/bfloat16, or cuSPARSE: see
`datapath.ops.plan`); on the CPU a plain-PyTorch implementation with the same signature and
semantics.  Graphs follow the `datapath.graph.CSR` protocol; what the ops derive from a graph
is kept in a cache keyed weakly by the graph object, never on the object itself.

    out = datapath.ops.aggregate(block, x, reduce="mean")          # (num_dst, F)
    out = datapath.ops.aggregate(block, table, src_ids=block_src)  # fused gather + aggregate
    plan = datapath.ops.plan_aggregation(graph, 128, probe=True)    # time the kernels once, keep the best
"""
from datapath.ops._checks import debug_checks, debug_checks_enabled, set_debug_checks
from datapath.ops._graph import CSRView, add_self_loops, as_csr, cached_keys
from datapath.ops.aggregate import aggregate, aggregate_transposed, prepare_aggregation, transposed_aggregator
from datapath.ops.attention import edge_softmax, sddmm
from datapath.ops.errors import (
    DeviceMismatchError,
    FeatureShapeError,
    GraphFormatError,
    GraphIndexError,
    UnsupportedDtypeError,
)
from datapath.ops.plan import KERNELS, AggregationPlan, plan_aggregation
from datapath.ops.typed import TypedRelations, compact_linear, concat_inputs, relations_into, stacked_mean, typed_linear

__all__ = [
    "KERNELS", "AggregationPlan", "CSRView", "DeviceMismatchError", "FeatureShapeError", "GraphFormatError",
    "GraphIndexError", "UnsupportedDtypeError", "add_self_loops", "aggregate", "aggregate_transposed", "as_csr",
    "cached_keys", "debug_checks", "debug_checks_enabled", "edge_softmax", "plan_aggregation", "prepare_aggregation",
    "sddmm", "set_debug_checks", "transposed_aggregator",
    "TypedRelations", "compact_linear", "concat_inputs", "relations_into", "stacked_mean", "typed_linear",
]
