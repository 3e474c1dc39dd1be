"""The heterogeneous branch of ``datapath train-gnn`` (``--model rgat|rgcn|hgt``): relational models on typed blocks.

One process: the `HeteroGraph` on the GPU (cuda, or unified with ``graph_on``) or the CPU, each node
type's features in a tensor (``features_on``) or, with ``gpu_cache`` / ``host_memory``, in a
`FeatureStore` of its own: ``gpu_cache`` is one budget for all types (a share of every feature byte,
or a size), spread over them by presampled reads per byte (`hetero_cache_rows`), the rest in pinned
host memory -- or read from the dataset directory's ``features_<type>.npy`` (``host_memory`` per type).
Epochs run through `datapath.apps.training.train_epoch`, the homogeneous models' loop.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from datapath.apps.training import evaluate, train_epoch
from datapath.features import FeatureStore, parse_budget
from datapath.graph import HETERO_PRESETS, HeteroData, generate_hetero, is_hetero_dataset
from datapath.loaders import HeteroNeighborLoader, hetero_cache_rows, hetero_hotness
from datapath.memory import to_placement
from datapath.nn import HeteroGNN
from datapath.nn.hetero_models import HETERO_MODELS
from datapath.sampling import HeteroNeighborSampler


def is_hetero_run(cfg: Any) -> bool:
    """Whether ``cfg`` names a relational model or a heterogeneous dataset."""
    return cfg.model in HETERO_MODELS or cfg.dataset in HETERO_PRESETS or is_hetero_dataset(cfg.dataset)


def load_hetero(cfg: Any, device: torch.device) -> HeteroData:
    if Path(cfg.dataset).is_dir():
        return HeteroData.load(cfg.dataset)
    return generate_hetero(cfg.dataset, seed=cfg.seed, device=device if device.type == "cuda" else "cpu")


def place(cfg: Any, data: HeteroData, device: torch.device) -> dict[str, Any]:
    """Put graph, features and labels where ``cfg`` says (in place on ``data``); facts about it."""
    cuda = device.type == "cuda"
    store = bool(cfg.gpu_cache) or bool(cfg.host_memory)
    graph_on = cfg.graph_on if cfg.graph_on not in (None, "auto") else ("cuda" if cuda else "cpu")
    data.graph = data.graph.to(graph_on)
    data.labels = data.labels.to(device)
    info: dict[str, Any] = {"graph_on": graph_on, "feature_bytes": data.feature_bytes}
    if store:
        sampler = HeteroNeighborSampler(list(cfg.fanouts), seed=cfg.seed)
        hot = hetero_hotness(data.graph, (data.target, data.train_idx), sampler, batch_size=cfg.batch_size,
                             seed=cfg.seed)
        row_bytes = {t: math.prod(x.shape[1:]) * x.element_size() for t, x in data.features.items()}
        budget = parse_budget(cfg.gpu_cache, info["feature_bytes"], "--gpu-cache") or 0
        cache_rows = hetero_cache_rows({t: hot[t] for t in data.features}, row_bytes, budget)
        directory = Path(cfg.dataset)
        stores = {}
        for t, x in data.features.items():
            source: Any = x
            if cfg.host_memory and directory.is_dir():
                source = directory / f"features_{t}.npy"
            stores[t] = FeatureStore(source, gpu_cache=cache_rows[t] * row_bytes[t], host_memory=cfg.host_memory,
                                     hotness=hot[t], device=device)
        data.features = stores
        cache = sum(s.cache_rows * s.row_bytes for s in stores.values())
        info.update(features_on="feature_store", gpu_cache_bytes=cache, gpu_cache_rows=cache_rows,
                    gpu_cache_frac=cache / max(info["feature_bytes"], 1),
                    feature_store={t: s.tiers() for t, s in stores.items()})
    else:
        where = cfg.features_on or ("unified" if cuda else "cpu")
        data.features = {t: to_placement(x, where) for t, x in data.features.items()}
        info.update(features_on=where, gpu_cache_frac=1.0 if where == "cuda" else 0.0)
    return info


def train_hetero(cfg: Any, num_workers: int = 1) -> dict[str, Any]:
    """Train ``cfg.model`` on the heterogeneous ``cfg.dataset`` in this process; per-epoch numbers and accuracy.

    ``num_workers``: the training loader's producer threads (`HeteroNeighborLoader`).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or getattr(cfg, "shard_features", False):
        raise ValueError("relational models (--model rgat|rgcn|hgt) train in one process for now: leave out --gpus, "
                         "torchrun and --shard-features")
    if cfg.device == "cuda" or (cfg.device is None and torch.cuda.is_available()):
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    t0 = time.perf_counter()
    data = load_hetero(cfg, device)
    info = place(cfg, data, device)
    setup_s = time.perf_counter() - t0
    hg = data.graph
    print(f"dataset {data.name}: {hg} ; {data.num_classes} classes of {data.target!r}, "
          f"{data.train_idx.numel():,} training nodes; features {info['feature_bytes'] / 2**30:.2f} GiB in "
          f"{info['features_on']} (GPU cache {info.get('gpu_cache_frac', 0):.0%}) ({setup_s:.1f} s)", flush=True)
    torch.manual_seed(cfg.seed)
    widths = {t: int(x.shape[1]) for t, x in data.features.items()}
    model = HeteroGNN(cfg.model, hg.metadata, widths, hg.num_nodes, cfg.hidden, data.num_classes, len(cfg.fanouts),
                      heads=cfg.heads, dropout=cfg.dropout, target=data.target).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sampler = HeteroNeighborSampler(list(cfg.fanouts), seed=cfg.seed)
    kw = dict(features=data.features, labels=data.labels, device=device, seed=cfg.seed, prefetch=cfg.prefetch)
    loader = HeteroNeighborLoader(hg, (data.target, data.train_idx), sampler, cfg.batch_size, shuffle=True,
                                  prepare=model.prepare_batch, num_workers=num_workers, **kw)
    gen = torch.Generator().manual_seed(cfg.seed)

    def eval_loader(idx: torch.Tensor) -> HeteroNeighborLoader | None:
        if cfg.eval_nodes == 0 or idx.numel() == 0:
            return None
        idx = idx[torch.randperm(idx.numel(), generator=gen)[: cfg.eval_nodes]]
        return HeteroNeighborLoader(hg, (data.target, idx), HeteroNeighborSampler(list(cfg.fanouts), seed=cfg.seed + 1),
                                    4 * cfg.batch_size, **kw)

    val_loader, test_loader = eval_loader(data.val_idx), eval_loader(data.test_idx)
    history = []
    stores = [x for x in data.features.values() if isinstance(x, FeatureStore)]
    for epoch in range(cfg.epochs):
        for st in stores:
            st.reset_stats()
        stats = train_epoch(model, loader, opt, cfg.max_batches, epoch=epoch, allow_nonfinite=cfg.allow_nonfinite)
        row = {"epoch": epoch, **{k: v for k, v in stats.as_dict().items() if k != "losses"}}
        if stores:  # the training batches' rows: the GPU cache's share of them, and the bytes read from host memory
            tiers = [st.stats() for st in stores]
            rows = sum(v["rows"] for t in tiers for v in t.values())
            row["gpu_hit_rate"] = sum(t["gpu_cache"]["rows"] for t in tiers) / max(rows, 1)
            row["host_read_bytes"] = sum(t["host"]["bytes"] for t in tiers)
        val = evaluate(model, val_loader) if val_loader is not None else None
        row["val_acc"] = val
        history.append(row)
        n = stats.batches * cfg.batch_size
        hit = f", GPU cache hit {row['gpu_hit_rate']:.0%}" if stores else ""
        print(f"epoch {epoch}: loss {stats.loss:.4f}  train acc {stats.train_acc:.3f}  val acc "
              f"{'-' if val is None else f'{val:.3f}'}  time {stats.epoch_s:.2f} s  (~{n / stats.epoch_s:,.0f} seeds/s; "
              f"steps {stats.train_s:.2f} s, their CPU {stats.consumer_cpu_s:.2f} s; waiting for data "
              f"{stats.wait_s:.2f} s; producers: sample {stats.sample_s:.2f} s, gather+prepare {stats.gather_s:.2f} s, "
              f"CPU {stats.producer_cpu_s:.2f} s, host waits {stats.producer_gpu_wait_s:.2f} s{hit})", flush=True)
    test = evaluate(model, test_loader) if test_loader is not None else None
    if test is not None:
        print(f"test accuracy {test:.3f} (chance {1 / data.num_classes:.3f})")
    result = {"dataset": data.name, "model": cfg.model, "device": str(device), "setup_s": setup_s,
              "history": history, "test_acc": test, **{k: v for k, v in info.items() if k != "feature_store"}}
    if getattr(cfg, "json", None):
        Path(cfg.json).write_text(json.dumps(result, indent=1, default=str))
    return result
