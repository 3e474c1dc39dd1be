"""Placing a run's data through a `datapath.features.FeatureStore`: ``--gpu-cache``, ``--host-memory``, ``--shard-features``.

The graph goes on the GPU when its CSR fits beside the cache (unified otherwise), the
labels on the training device, and the features into a store whose GPU cache holds the
hottest rows (ranked by presampling the run's own sampler, or by degree).  With
``--host-memory`` smaller than the features of a dataset directory, the store reads the
rest of ``features.npy`` from disk.

With ``--shard-features`` (`place_sharded`) every rank of the job loads the whole graph, labels
and splits but only its own shard of the features (its shard file of ``prepare-dataset
--shards N``, or its rows of ``features.npy``), and the features go into a sharded store
(`datapath.features.sharded_store`) that fetches the other ranks' rows from them.  No shared
memory segment is made.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from datapath.apps.launch import DistContext, on_every_rank
from datapath.features import (
    DiskOptions, FeatureStore, degree_hotness, gpu_budget, parse_budget, place_graph, presample_hotness, sharded_store,
)
from datapath.graph import Dataset, load_dataset
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler

log = logging.getLogger("datapath.apps.store_placement")

CACHE_POLICIES = ("presample", "degree")
PRESAMPLE_BATCHES = 64


def uses_store(cfg: Any) -> bool:
    """True when the run asks for a feature store (tiered, or sharded over the ranks)."""
    return bool(cfg.gpu_cache) or bool(cfg.host_memory) or bool(getattr(cfg, "shard_features", False))


def _place_graph_and_labels(cfg: Any, device: torch.device, ds: Dataset, cache_bytes: int) -> None:
    graph_on = cfg.graph_on or "auto"
    if device.type != "cuda":
        ds.graph = ds.graph.to("cpu" if graph_on == "auto" else graph_on)
    elif graph_on == "auto":
        ds.graph = place_graph(ds.graph, gpu_budget(cache_bytes))
    else:
        ds.graph = ds.graph.to(graph_on)
    ds.labels = to_placement(ds.labels, "cuda" if device.type == "cuda" else "cpu")


def _hotness(cfg: Any, ds: Dataset) -> torch.Tensor:
    if cfg.cache_policy == "degree":
        return degree_hotness(ds.graph)
    sampler = NeighborSampler(list(cfg.fanouts), seed=cfg.seed)
    return presample_hotness(ds.graph, ds.train_idx, sampler, batch_size=cfg.batch_size,
                             batches=PRESAMPLE_BATCHES, seed=cfg.seed)


def place_with_store(cfg: Any, device: torch.device, ds: Dataset) -> tuple[Dataset, dict[str, Any]]:
    """``ds`` with the graph placed, labels on ``device`` and the features in a `FeatureStore`."""
    feature_bytes = ds.features.numel() * ds.features.element_size()
    cache_bytes = parse_budget(cfg.gpu_cache, feature_bytes, "--gpu-cache") or 0
    _place_graph_and_labels(cfg, device, ds, cache_bytes)
    hot = _hotness(cfg, ds)
    directory = Path(cfg.dataset)
    source: Any = ds.features
    disk = None
    if cfg.host_memory and directory.is_dir():
        source = directory / "features.npy"  # rows beyond host memory are read from this file
        if getattr(cfg, "disk_superbatch", None):
            disk = DiskOptions(superbatch=cfg.disk_superbatch)
    ds.features = FeatureStore(source, gpu_cache=cfg.gpu_cache, host_memory=cfg.host_memory, hotness=hot,
                               device=device, disk=disk)
    return ds, {"features_on": "feature_store", "graph_on": ds.graph.placement, "shared_prefix": None,
                "feature_store": ds.features.tiers()}


def place_sharded(cfg: Any, ctx: DistContext) -> tuple[Dataset, dict[str, Any]]:
    """This rank's part of dataset directory ``cfg.dataset`` (graph replicated, features sharded), in a sharded store.

    Every rank calls it.  A rank that cannot load its part (a missing or malformed shard file, a
    job of another size than the prepared shards) raises its error, and every other rank an
    error naming that rank, before any exchange starts.
    """
    ds = on_every_rank(ctx, lambda: load_dataset(Path(cfg.dataset), shard=(ctx.rank, ctx.world_size)),
                       "load its part of the dataset")
    layout = ds.feature_layout
    width = int(ds.features.shape[1])
    cache_bytes = parse_budget(cfg.gpu_cache, layout.num_rows * width * ds.features.element_size(), "--gpu-cache") or 0
    _place_graph_and_labels(cfg, ctx.device, ds, cache_bytes)
    hot = _hotness(cfg, ds) if cache_bytes else None
    lo, hi = layout.rows(ctx.rank)
    ds.features = sharded_store(ds.features, layout, gpu_cache=cfg.gpu_cache, hotness=hot,
                                cache_scope=cfg.cache_scope, device=ctx.device, timeout_s=cfg.dist_timeout_s)
    return ds, {"features_on": "sharded", "graph_on": ds.graph.placement, "shared_prefix": None,
                "feature_store": ds.features.tiers(),
                "feature_shard": {"rank": ctx.rank, "shards": layout.shards, "rows": [lo, hi]}}
