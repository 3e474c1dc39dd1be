"""Mini-batch loading for out-of-core GNN training: `NeighborLoader` composes sampling and feature fetch.

    graph = Graph.load("products/").to("unified")            # datapath.graph: pinned in place, read over PCIe
    loader = NeighborLoader(graph, train_idx, NeighborSampler([15, 10, 5]), batch_size=1024,
                            shuffle=True, features=feats, labels=labels, device="cuda")
    for batch in loader:                                      # sampled and gathered on the GPU, prefetched
        out = model(batch.blocks, batch.x)                    # blocks: input layer first
        loss = F.cross_entropy(out, batch.y)

The graph lives in `datapath.graph`, the sampler in `datapath.sampling`, the row fetch in
`datapath.memory`; this package only puts them together (and hands batches over from
background threads).  Blocks convert to PyG's form with ``block.to_pyg()``.
"""
from datapath._deprecated import forward
from datapath.loaders.batch import Batch
from datapath.loaders.collective_order import CollectiveOrder
from datapath.loaders.distributed import DistributedNeighborLoader, RankBatch
from datapath.loaders.errors import LoaderError
from datapath.loaders.hetero import HeteroBatch, HeteroNeighborLoader, hetero_cache_rows, hetero_hotness
from datapath.loaders.loader import NeighborLoader

__all__ = [
    "Batch", "CollectiveOrder", "DistributedNeighborLoader", "HeteroBatch", "HeteroNeighborLoader", "LoaderError",
    "NeighborLoader", "RankBatch", "hetero_cache_rows", "hetero_hotness",
]

__getattr__ = forward(__name__)  # old paths (datapath.loaders.Graph, .train_epoch, ...), one more release
