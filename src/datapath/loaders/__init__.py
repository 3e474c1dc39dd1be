"""Out-of-core GNN data loading: graphs, GPU neighbor sampling, zero-copy feature loading, datasets.

    graph = Graph.load("products/").to("unified")            # pinned in place, read by the GPU over PCIe
    feats = torch.from_numpy(np.load(...)).to("unified")      # the node features too
    loader = NeighborLoader(graph, train_idx, NeighborSampler([15, 10, 5]), batch_size=1024,
                            shuffle=True, features=feats, labels=labels, device="cuda")
    for batch in loader:                                      # sampled and gathered on the GPU, prefetched
        out = model(batch.blocks, batch.x)                    # blocks: input layer first
        loss = F.cross_entropy(out, batch.y)

Blocks convert to PyG's form with ``block.to_pyg()`` -> ``(edge_index, (num_src, num_dst))``.
"""
from datapath.loaders.block import Block
from datapath.loaders.datasets import (
    PRESETS,
    Dataset,
    SyntheticSpec,
    generate,
    get_dataset,
    load_dataset,
    papers_spec,
    prepare_dataset,
    preset_spec,
)
from datapath.loaders.distributed import (
    DistContext, DistributedError, DistributedNeighborLoader, attach_dataset, init_distributed, launch,
    memory_footprint, share_dataset, shared_dataset, shutdown_distributed,
)
from datapath.loaders.errors import CudaAutogradUnavailableError, DatasetError, InvalidGraphError, LoaderError
from datapath.loaders.graph import Graph, validate_csr
from datapath.loaders.loader import Batch, NeighborLoader
from datapath.loaders.sampler import NeighborSampler
from datapath.loaders.training import EpochStats, evaluate, profile_batches, train_epoch

__all__ = [
    "DistContext", "DistributedError", "DistributedNeighborLoader", "attach_dataset", "init_distributed",
    "launch", "memory_footprint", "share_dataset", "shared_dataset", "shutdown_distributed",
    "PRESETS", "Batch", "Block", "CudaAutogradUnavailableError", "Dataset", "DatasetError", "EpochStats", "Graph", "InvalidGraphError",
    "LoaderError", "NeighborLoader", "NeighborSampler", "SyntheticSpec", "evaluate", "generate", "get_dataset",
    "load_dataset", "papers_spec", "prepare_dataset", "preset_spec", "profile_batches", "train_epoch",
    "validate_csr",
]
