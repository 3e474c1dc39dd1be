"""A tiered feature store: a GPU cache of hot rows, pinned host memory read zero-copy, and files on disk.

    from datapath.features import FeatureStore, presample_hotness, place_graph
    graph = place_graph(graph, budget_bytes)          # CSR on the GPU when it fits, unified otherwise
    hot = presample_hotness(graph, train_idx, [15, 10, 5])
    feats = FeatureStore("data/features.npy", gpu_cache="25%", host_memory="16GB", hotness=hot)
    loader = NeighborLoader(graph, train_idx, [15, 10, 5], features=feats, labels=labels)
    feats.stats()   # {"gpu_cache": {"rows", "bytes", "seconds", "hit_rate"}, "host": ..., "disk": ...}

Modules: `store` (FeatureStore), `tiers` (TierStats, FetchTier: the interface a further tier,
e.g. a remote shard, implements), `disk` (the disk tier and its O_DIRECT engines),
`scan` (the disk's costs, `probe_disk`; `choose_gap`: random reads or a scan; `read_rows`), `superbatch`
(`Schedule`: the disk rows of many batches read at once, Ginex), `table_file` (TableFile, `write_table`), `hotness` (what to cache), `budget` (``"25%"``, ``"16GB"``),
`placement` (the graph's place), `sharded` (the rows cut over the ranks of a torch.distributed job:
`sharded_store`, `ShardedTier`).
"""
from datapath.features.budget import format_bytes, parse_budget
from datapath.features.disk import ENGINES, DiskReader, DiskTier, ReadPlan, native_aio_available, plan_reads
from datapath.features.errors import DiskReadError, FeatureStoreError, ShardExchangeError
from datapath.features.hotness import degree_hotness, presample_hotness, rank
from datapath.features.placement import GPU_RESERVE_BYTES, gpu_budget, graph_bytes, place_graph
from datapath.features.sharded import CACHE_SCOPES, ShardedTier, new_exchange_group, sharded_store
from datapath.features.scan import (
    BOUNCE_BUFFERS, BOUNCE_BYTES, GAPS, SCAN, DiskCosts, GapChoice, ReadResult, choose_gap, probe_disk, read_rows,
    run_groups,
)
from datapath.features.store import DiskOptions, FeatureStore, PendingGather
from datapath.features.superbatch import Schedule, StagingPool
from datapath.features.table_file import TableFile, write_table
from datapath.features.tiers import FetchTier, TierStats

__all__ = [
    "BOUNCE_BUFFERS", "BOUNCE_BYTES", "CACHE_SCOPES", "DiskCosts", "DiskOptions", "GAPS", "GapChoice", "ReadResult", "SCAN", "Schedule", "StagingPool",
    "choose_gap", "probe_disk", "read_rows", "run_groups", "write_table", "DiskReadError", "DiskReader", "DiskTier", "ENGINES", "FeatureStore", "FeatureStoreError", "PendingGather",
    "FetchTier", "GPU_RESERVE_BYTES", "ReadPlan", "ShardExchangeError", "ShardedTier", "TableFile", "TierStats",
    "degree_hotness", "format_bytes", "gpu_budget", "graph_bytes", "native_aio_available", "new_exchange_group",
    "parse_budget", "place_graph", "plan_reads", "presample_hotness", "rank", "sharded_store",
]
