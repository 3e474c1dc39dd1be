"""Placing a one-process run's data through a `datapath.features.FeatureStore` (``--gpu-cache``, ``--host-memory``).

The graph goes on the GPU when its CSR fits beside the cache (unified otherwise), the
labels on the training device, and the features into a store whose GPU cache holds the
hottest rows (ranked by presampling the run's own sampler, or by degree).  With
``--host-memory`` smaller than the features of a dataset directory, the store reads the
rest of ``features.npy`` from disk.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from datapath.features import FeatureStore, degree_hotness, gpu_budget, parse_budget, place_graph, presample_hotness
from datapath.graph import Dataset
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler

log = logging.getLogger("datapath.apps.store_placement")

CACHE_POLICIES = ("presample", "degree")
PRESAMPLE_BATCHES = 64


def uses_store(cfg: Any) -> bool:
    """True when the run asks for a feature store."""
    return bool(cfg.gpu_cache) or bool(cfg.host_memory)


def place_with_store(cfg: Any, device: torch.device, ds: Dataset) -> tuple[Dataset, dict[str, Any]]:
    """``ds`` with the graph placed, labels on ``device`` and the features in a `FeatureStore`."""
    feature_bytes = ds.features.numel() * ds.features.element_size()
    cache_bytes = parse_budget(cfg.gpu_cache, feature_bytes, "--gpu-cache") or 0
    graph_on = cfg.graph_on or "auto"
    if device.type != "cuda":
        ds.graph = ds.graph.to("cpu" if graph_on == "auto" else graph_on)
    elif graph_on == "auto":
        ds.graph = place_graph(ds.graph, gpu_budget(cache_bytes))
    else:
        ds.graph = ds.graph.to(graph_on)
    ds.labels = to_placement(ds.labels, "cuda" if device.type == "cuda" else "cpu")
    if cfg.cache_policy == "degree":
        hot = degree_hotness(ds.graph)
    else:
        sampler = NeighborSampler(list(cfg.fanouts), seed=cfg.seed)
        hot = presample_hotness(ds.graph, ds.train_idx, sampler, batch_size=cfg.batch_size,
                                batches=PRESAMPLE_BATCHES, seed=cfg.seed)
    directory = Path(cfg.dataset)
    source: Any = ds.features
    if cfg.host_memory and directory.is_dir():
        source = directory / "features.npy"  # rows beyond host memory are read from this file
    ds.features = FeatureStore(source, gpu_cache=cfg.gpu_cache, host_memory=cfg.host_memory, hotness=hot,
                               device=device)
    return ds, {"features_on": "feature_store", "graph_on": ds.graph.placement, "shared_prefix": None,
                "feature_store": ds.features.tiers()}
