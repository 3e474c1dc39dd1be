"""Where the graph structure goes: on the GPU when its CSR fits a budget, unified (pinned in place) otherwise."""
from __future__ import annotations

import logging

import torch

from datapath.graph import Graph
from datapath.memory import placement_of
from datapath.unified_tensor import as_unified

log = logging.getLogger("datapath.features.placement")

GPU_RESERVE_BYTES = 4 << 30
"""GPU memory `gpu_budget` leaves free for training (activations, gradients, the loader's buffers)."""


def graph_bytes(graph: Graph) -> int:
    """Bytes of the graph's CSR arrays."""
    ts = [graph.indptr, graph.indices] + ([graph.edge_ids] if graph.edge_ids is not None else [])
    return sum(t.numel() * t.element_size() for t in ts)


def gpu_budget(reserved_bytes: int = 0) -> int:
    """Free GPU memory now, less ``reserved_bytes`` (memory about to be taken) and `GPU_RESERVE_BYTES`."""
    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info()
    return max(0, free - reserved_bytes - GPU_RESERVE_BYTES)


def place_graph(graph: Graph, budget_bytes: int | None = None) -> Graph:
    """``graph`` on the GPU when its CSR fits ``budget_bytes`` (default `gpu_budget()`), else in unified memory.

    Unified: the arrays are pinned where they lie (no copy) and GPU sampling reads them over
    PCIe; on the GPU, sampling reads HBM.  Without CUDA the graph is returned as it is.
    """
    if not torch.cuda.is_available():
        return graph
    need = graph_bytes(graph)
    budget = gpu_budget() if budget_bytes is None else budget_bytes
    if need <= budget:
        log.info("graph on the GPU (%.2f GiB of a %.2f GiB budget)", need / 2**30, budget / 2**30)
        return graph.to("cuda")
    log.info("graph in unified memory (%.2f GiB > GPU budget %.2f GiB)", need / 2**30, budget / 2**30)
    if graph.placement == "unified":
        return graph
    if graph.placement == "cuda":
        return graph.to("unified")

    def pin(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else (t if placement_of(t) == "unified" else as_unified(t))

    return Graph(pin(graph.indptr), pin(graph.indices), edge_ids=pin(graph.edge_ids),
                 num_src_nodes=graph.num_src_nodes, validate=False)
