"""A tiered feature store: a GPU cache of hot rows, pinned host memory read zero-copy, and files on disk.

    from datapath.features import FeatureStore, presample_hotness, place_graph
    graph = place_graph(graph, budget_bytes)          # CSR on the GPU when it fits, unified otherwise
    hot = presample_hotness(graph, train_idx, [15, 10, 5])
    feats = FeatureStore("data/features.npy", gpu_cache="25%", host_memory="16GB", hotness=hot)
    loader = NeighborLoader(graph, train_idx, [15, 10, 5], features=feats, labels=labels)
    feats.stats()   # {"gpu_cache": {"rows", "bytes", "seconds", "hit_rate"}, "host": ..., "disk": ...}

This package exports what a user calls.  The parts behind it are documented submodules, imported
from there: `store` (FeatureStore), `disk_options` (DiskOptions), `pending_gather` (PendingGather: a
gather in parts), `tiers` (TierStats, FetchTier: the interface a
further tier, e.g. a remote shard, implements), `disk` (the disk tier, its O_DIRECT engines,
`plan_reads`), `scan` (the disk's costs, `probe_disk`; `choose_gap`: random reads or a scan;
`read_rows`; `BOUNCE_BUFFERS`, `GAPS`, `SCAN`), `superbatch` (`Schedule`: the disk rows of many
batches read at once, Ginex), `table_file` (TableFile, `write_table`), `hotness` (what to cache,
`rank`), `budget` (``"25%"``, ``"16GB"``), `placement` (the graph's place), `sharded` (the rows cut
over the ranks of a torch.distributed job: `sharded_store`, `ShardedTier`, `CACHE_SCOPES`), `exchange`
(`ShardedTier`: the exchange of rows between the ranks; its steps in `exchange_steps`).
"""
from datapath._deprecated import forward
from datapath.features.budget import format_bytes, parse_budget
from datapath.features.disk_options import DiskOptions
from datapath.features.errors import DiskReadError, FeatureStoreError, ShardExchangeError
from datapath.features.hotness import degree_hotness, presample_hotness
from datapath.features.placement import gpu_budget, place_graph
from datapath.features.sharded import new_exchange_group, sharded_store
from datapath.features.store import FeatureStore
from datapath.features.table_file import TableFile, write_table

__all__ = [
    "DiskOptions", "DiskReadError", "FeatureStore", "FeatureStoreError", "ShardExchangeError", "TableFile",
    "degree_hotness", "format_bytes", "gpu_budget", "new_exchange_group", "parse_budget", "place_graph",
    "presample_hotness", "sharded_store", "write_table",
]

__getattr__ = forward(__name__)  # the wider face of 0.1 (disk internals, tiers): from the submodules, one release
