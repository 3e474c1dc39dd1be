"""Neighbour sampling: message-flow `Block`s built on the GPU (or the CPU) from a `datapath.graph.Graph`.

    from datapath.sampling import NeighborSampler
    blocks = NeighborSampler([15, 10, 5]).sample(graph, seeds_cuda)   # input layer first

The GPU path reads a graph in unified memory over PCIe; the CPU path is its exact twin
(same counter-based random numbers, same first-occurrence relabelling), so a sample is a
pure function of (seed, step, graph, seeds) on either device.
"""
from datapath.sampling.block import Block
from datapath.sampling.errors import SamplingError
from datapath.sampling.hetero import HeteroNeighborSampler
from datapath.sampling.hetero_block import HeteroBlock, RelationBlock
from datapath.sampling.neighbor_sampler import NeighborSampler, PendingSample
from datapath.sampling.relabel import relabel, relabel_dense

__all__ = [
    "Block", "HeteroBlock", "HeteroNeighborSampler", "NeighborSampler", "PendingSample", "RelationBlock",
    "SamplingError", "relabel", "relabel_dense",
]
