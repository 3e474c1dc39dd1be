"""GNN aggregation ops: neighbor aggregation (SpMM), SDDMM and edge softmax, with autograd.

On CUDA tensors they run GNNAdvisor-style kernels (neighbor groups, dimension workers,
warp-aligned mapping, shared-memory accumulation, an analytical launch model); on the
CPU a plain-PyTorch implementation with the same signature and semantics.

    out = datapath.ops.aggregate(block, x, reduce="mean")          # (num_dst, F)
    out = datapath.ops.aggregate(block, table, src_ids=block_src)  # fused gather + aggregate
    plan = datapath.ops.plan_aggregation(block, 128)                # inspect / override the launch
"""
from datapath.ops._graph import CSRGraph, CSRView, add_self_loops, as_csr
from datapath.ops.aggregate import aggregate, prepare_aggregation
from datapath.ops.attention import edge_softmax, sddmm
from datapath.ops.errors import (
    DeviceMismatchError,
    FeatureShapeError,
    GraphFormatError,
    GraphIndexError,
    UnsupportedDtypeError,
)
from datapath.ops.plan import AggregationPlan, plan_aggregation

__all__ = [
    "AggregationPlan", "CSRGraph", "CSRView", "DeviceMismatchError", "FeatureShapeError", "GraphFormatError",
    "GraphIndexError", "UnsupportedDtypeError", "add_self_loops", "aggregate", "as_csr", "edge_softmax",
    "plan_aggregation", "prepare_aggregation", "sddmm",
]
