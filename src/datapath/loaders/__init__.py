"""Out-of-core GNN data loading: graphs, GPU neighbor sampling, zero-copy feature loading, datasets.

    graph = Graph.load("products/").to("unified")          # pinned in place, read by the GPU over PCIe
    feats = datapath.unified_tensor.as_unified(features)    # same for the node features
    loader = NeighborLoader(graph, train_idx, NeighborSampler([15, 10, 5]), batch_size=1024,
                            features=feats, labels=labels, device="cuda")
    for batch in loader:
        out = model(batch.blocks, batch.x)                  # blocks: input layer first
        loss = F.cross_entropy(out, batch.y)
"""
from datapath.loaders.block import Block
from datapath.loaders.errors import DatasetError, InvalidGraphError, LoaderError
from datapath.loaders.graph import Graph, validate_csr
from datapath.loaders.sampler import NeighborSampler

__all__ = [
    "Block", "DatasetError", "Graph", "InvalidGraphError", "LoaderError", "NeighborSampler", "validate_csr",
]
