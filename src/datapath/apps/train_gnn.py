"""The GNN training job behind ``datapath train-gnn``: one loop for one process and for data parallelism.

    run_training(TrainConfig(dataset="products"))            # one process, this GPU (or the CPU)
    run_training(TrainConfig(dataset="products"), nprocs=2)  # spawns 2 processes, DDP
    # under torchrun every process calls run_training(cfg) and becomes one rank

A one-process run places the graph and the tables where ``graph_on``/``features_on``
say (unified: pinned host memory read by the GPU; cuda; cpu), or, with ``gpu_cache`` /
``host_memory``, puts the features into a tiered `datapath.features.FeatureStore`
(`datapath.apps.store_placement`).  A multi-process run
keeps ONE shared host copy of graph and tables for all ranks (`shared_dataset`) and
trains with DDP; ``batch_size`` is per rank.  With ``shard_features`` each rank (on any
number of machines) loads the graph and only its shard of the features, and fetches the
others' rows from them (`datapath.features.sharded_store`); no shared segment.  All go
through `train`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from datapath.apps import checkpoint
from datapath.apps.errors import DistributedError
from datapath.apps.launch import (
    DistContext, _leave_together, all_gather_objects, in_launched_job, init_distributed, launch, rank_error,
    shutdown_distributed,
)
from datapath.apps.shared_data import memory_footprint, segment_bytes, shared_dataset
from datapath.apps.store_placement import CACHE_POLICIES, place_sharded, place_with_store, uses_store
from datapath.apps.training import evaluate, train_epoch
from datapath.features import FeatureStore, parse_budget
from datapath.features.sharded import CACHE_SCOPES
from datapath.graph import Dataset, get_dataset
from datapath.loaders import Batch, DistributedNeighborLoader, NeighborLoader, RankBatch
from datapath.memory import PLACEMENTS, placement_of, to_placement
from datapath.nn.models import build_model
from datapath.sampling import NeighborSampler

log = logging.getLogger("datapath.apps.train_gnn")

OPTIMIZERS = ("adam", "sgd")
MODELS = ("sage", "gat", "rgat", "rgcn", "hgt")  # the last three: relational models on heterogeneous datasets


@dataclass
class TrainConfig:
    """One GNN training job.

    ``batch_size`` is per process (global batch = processes x batch_size).  ``features_on`` /
    ``graph_on``: where a one-process run keeps the tables and the graph (``unified``, ``cuda``,
    ``cpu``; default unified on a GPU, cpu otherwise; the graph follows the features); a
    multi-process run always keeps one shared unified copy.  ``gpu_cache`` / ``host_memory``
    (``"25%"``, ``"16GB"``): a one-process run serves the features from a `FeatureStore` with a GPU
    cache of that size (the hottest rows by ``cache_policy``: ``presample`` or ``degree``) and, for a
    dataset directory, that much pinned host memory, the rest read from disk (``disk_superbatch``:
    that much of it, ``"20%"`` of the features or ``"8GB"``, stages the disk rows of many batches
    at once, read as only their pages or one sequential scan: `datapath.features.superbatch`); ``graph_on`` may
    then also be ``auto`` (the default: on the GPU when it fits beside the cache).  ``shard_features``: a
    dataset directory's features cut over the ranks, each holding its shard in (pinned) host memory
    and fetching the others' rows from them (``gpu_cache``: a GPU cache of hot rows of any shard on
    every rank, holding the hottest rows of any shard, or with ``cache_scope="own"`` of its own shard,
    served from there to the other ranks too); ``dist_timeout_s``: how long a rank waits for the others in a collective before it
    fails.  ``eval_nodes``: validation/test
    nodes evaluated after each epoch and at the end (0: no evaluation).  ``max_batches``:
    steps per epoch at most.  ``return_state``: rank 0's result carries the final parameters.
    ``allow_nonfinite``: train on past a NaN/inf loss (by default training stops naming the epoch and batch).
    ``save``: write a checkpoint (`datapath.apps.checkpoint`) into that directory after each epoch;
    ``resume``: continue the run saved there at its next epoch (and keep saving there unless ``save``).
    """

    dataset: str = "tiny"
    model: str = "sage"
    epochs: int = 4
    batch_size: int = 512
    fanouts: tuple[int, ...] = (10, 5)
    hidden: int = 128
    heads: int = 4
    dropout: float = 0.3
    lr: float = 3e-3
    optimizer: str = "adam"
    device: str | None = None
    features_on: str | None = None
    graph_on: str | None = None
    max_batches: int | None = None
    eval_nodes: int = 10_000
    memory_gb: float | None = None
    gpu_cache: str | None = None
    host_memory: str | None = None
    disk_superbatch: str | None = None
    cache_policy: str = "presample"
    shard_features: bool = False
    cache_scope: str = "any"
    dist_timeout_s: float = 600.0
    seed: int = 0
    prefetch: int = 1
    progress: bool = False
    json: str | None = None
    return_state: bool = False
    save: str | None = None
    resume: str | None = None
    allow_nonfinite: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting (before any data is built)."""
        ints = {"epochs": (self.epochs, 0), "batch_size": (self.batch_size, 1), "hidden": (self.hidden, 1),
                "heads": (self.heads, 1), "eval_nodes": (self.eval_nodes, 0), "prefetch": (self.prefetch, 0)}
        for name, (v, lo) in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.max_batches is not None and (not isinstance(self.max_batches, int) or self.max_batches < 1):
            raise ValueError(f"max_batches must be an integer >= 1 (or None for all), got {self.max_batches!r}")
        if not self.fanouts or any(isinstance(f, bool) or not isinstance(f, int) or f == 0 or f < -1
                                   for f in self.fanouts):
            raise ValueError(f"fanouts must be positive integers (or -1 for all neighbours), got {self.fanouts!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("features_on", "graph_on"):
            v = getattr(self, name)
            allowed = (*PLACEMENTS, "auto") if name == "graph_on" and uses_store(self) else PLACEMENTS
            if v is not None and v not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
        for name in ("gpu_cache", "host_memory", "disk_superbatch"):
            parse_budget(getattr(self, name), 1 << 40, name)  # FeatureStoreError (a ValueError) names it
        if self.disk_superbatch and not (self.host_memory and Path(self.dataset).is_dir()):
            raise ValueError("disk_superbatch stages the disk rows of a dataset directory read beyond host_memory: "
                             "pass host_memory and a dataset directory (datapath prepare-dataset PRESET DIR) too")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {CACHE_POLICIES}, got {self.cache_policy!r}")
        if uses_store(self) and self.features_on is not None:
            raise ValueError("features_on and gpu_cache/host_memory/shard_features exclude each other: the feature "
                             "store decides where each row lives")
        if self.shard_features and self.host_memory:
            raise ValueError("shard_features and host_memory exclude each other: each rank holds its whole shard in "
                             "host memory; use more ranks (smaller shards) when a shard does not fit")
        if self.shard_features and not Path(self.dataset).is_dir():
            raise ValueError(f"shard_features needs a dataset directory (each rank loads only its shard of the "
                             f"features), not the preset {self.dataset!r}: run `datapath prepare-dataset "
                             f"{self.dataset} DIR --shards N` and pass --dataset DIR")
        if self.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"cache_scope must be one of {CACHE_SCOPES}, got {self.cache_scope!r}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s!r}")
        if self.device == "cpu" and "cuda" in (self.features_on, self.graph_on):
            raise ValueError("features_on/graph_on 'cuda' need device 'cuda'")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb!r}")
        if self.save is not None and Path(self.save).exists() and not Path(self.save).is_dir():
            raise ValueError(f"save: {self.save} is a file; give a directory for the checkpoint")
        if self.resume is not None and not (Path(self.resume) / checkpoint.FILE).is_file():
            raise ValueError(f"resume: {self.resume} holds no {checkpoint.FILE} (written by train-gnn --save DIR)")
        if self.json is not None:
            parent = Path(self.json).expanduser().resolve().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise ValueError(f"cannot write the JSON output {self.json}: {parent} is not a writable directory")


def global_mean_loss(world_size: int) -> Callable[[torch.Tensor, Batch], torch.Tensor]:
    """Loss for `train_epoch` under DDP: ``world_size * sum(CE of this rank's seeds) / global batch size``.

    DDP averages gradients over ranks, so the update is that of the mean cross-entropy
    over the whole global batch, even when the ranks' parts differ in size.  Needs
    the batches of a `DistributedNeighborLoader` (`RankBatch`).
    """
    def loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
        if not isinstance(batch, RankBatch):
            raise DistributedError("global_mean_loss needs batches from a DistributedNeighborLoader")
        return F.cross_entropy(out, batch.y, reduction="sum") * (world_size / batch.global_batch_size)

    return loss


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``model`` in DistributedDataParallel (itself with one process)."""
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def make_optimizer(name: str, params: Any, lr: float, fused: bool = False) -> torch.optim.Optimizer:
    """``"adam"`` or ``"sgd"`` (momentum 0.9)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _build_dataset(cfg: TrainConfig, device: torch.device) -> Callable[[], Dataset]:
    def make() -> Dataset:
        gen_dev = "cpu" if cfg.dataset == "tiny" or device.type == "cpu" else str(device)
        return get_dataset(cfg.dataset, progress=cfg.progress, memory_gb=cfg.memory_gb, seed=cfg.seed,
                           device=gen_dev)
    return make


def _place(cfg: TrainConfig, ctx: DistContext, make: Callable[[], Dataset]) -> tuple[Dataset, dict[str, Any]]:
    """The dataset with graph and tables where this run keeps them, and facts about that."""
    if cfg.shard_features:
        return place_sharded(cfg, ctx)
    if ctx.world_size > 1:
        ds = shared_dataset(ctx, make)
        where = placement_of(ds.features)
        if ctx.device.type == "cuda" and where != "unified":
            raise DistributedError(f"the shared features are in {where!r} memory, not pinned; "
                                   f"cannot read them zero-copy")
        return ds, {"features_on": where, "graph_on": where, "shared_prefix": ds.prefix}
    ds = make()
    if uses_store(cfg):
        return place_with_store(cfg, ctx.device, ds)
    features_on = cfg.features_on or ("unified" if ctx.device.type == "cuda" else "cpu")
    graph_on = cfg.graph_on or features_on
    ds.graph = ds.graph.to(graph_on)
    ds.features = to_placement(ds.features, features_on)
    ds.labels = to_placement(ds.labels, features_on)
    return ds, {"features_on": features_on, "graph_on": graph_on, "shared_prefix": None}


def _loader(cfg: TrainConfig, ctx: DistContext, ds: Dataset, seeds: torch.Tensor, batch_size: int,
            seed: int, shuffle: bool, prepare: Any = None, max_steps: int | None = None) -> NeighborLoader:
    sampler = NeighborSampler(list(cfg.fanouts), seed=seed)
    kw = dict(features=ds.features, labels=ds.labels, device=ctx.device, seed=cfg.seed, prefetch=cfg.prefetch,
              prepare=prepare)
    if ctx.world_size == 1:
        return NeighborLoader(ds.graph, seeds, sampler, batch_size, shuffle=shuffle, **kw)
    # sharded features: every rank makes exactly the epoch's steps (their row exchanges pair up)
    return DistributedNeighborLoader(ds.graph, seeds, sampler, batch_size, shuffle=shuffle, rank=ctx.rank,
                                     world_size=ctx.world_size, max_steps=max_steps if cfg.shard_features else None,
                                     **kw)


def _seeds_in(loader: NeighborLoader, batches: int) -> int:
    if isinstance(loader, DistributedNeighborLoader):
        return loader.seeds_in(batches)
    return min(loader.seeds.numel(), batches * loader.batch_size)


def _accuracy(ctx: DistContext, model: torch.nn.Module, loader: NeighborLoader | None) -> float | None:
    """Accuracy over every rank's part of ``loader``'s seeds (None without evaluation)."""
    if loader is None:
        return None
    acc, n = evaluate(model, loader), _seeds_in(loader, len(loader))
    parts = all_gather_objects(ctx, (acc * n, n))
    return sum(a for a, _ in parts) / max(sum(c for _, c in parts), 1)


def _aggregate(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's numbers from the ranks' epoch rows: slowest rank's time, total seeds, weighted loss/acc."""
    seeds = sum(r["seeds"] for r in ranks)
    epoch_s = max(r["epoch_s"] for r in ranks)
    return {"epoch_s": epoch_s, "seeds": seeds, "seeds_per_s": seeds / epoch_s if epoch_s else 0.0,
            "batches": ranks[0]["batches"], "loss": sum(r["loss"] for r in ranks) / len(ranks),
            "train_acc": sum(r["train_acc"] * r["seeds"] for r in ranks) / max(seeds, 1),
            "sample_s": max(r["sample_s"] for r in ranks), "gather_s": max(r["gather_s"] for r in ranks),
            "train_s": max(r["train_s"] for r in ranks), "wait_s": max(r["wait_s"] for r in ranks),
            "cpu_s": sum(r["cpu_s"] for r in ranks),
            "peak_gpu_bytes": max((r["peak_gpu_bytes"] or 0) for r in ranks) or None}


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the job in this process (one rank of it under torchrun or `launch`); returns this rank's numbers.

    Rank 0 prints the progress lines and writes ``cfg.json``.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    cfg.validate()
    from datapath.apps.train_hetero import is_hetero_run, train_hetero  # noqa: PLC0415

    if is_hetero_run(cfg):  # relational models on a heterogeneous dataset: one process
        return train_hetero(cfg)
    ctx = init_distributed(cfg.device, timeout_s=cfg.dist_timeout_s)
    if ctx.device.type == "cpu" and ctx.world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    say = print if ctx.is_main else (lambda *a, **k: None)
    t0 = time.perf_counter()
    ds, where = _place(cfg, ctx, _build_dataset(cfg, ctx.device))
    setup_s = time.perf_counter() - t0
    if where["shared_prefix"]:
        copy = f"one shared copy ({segment_bytes(ds.prefix)['nbytes'] / 2**30:.2f} GiB) for {ctx.world_size} processes"
    elif cfg.shard_features:
        copy = (f"graph replicated on every rank in {where['graph_on']} memory, features cut into "
                f"{where['feature_shard']['shards']} shards, one per rank; rank 0's store {ds.features.describe()}")
    elif isinstance(ds.features, FeatureStore):
        copy = f"graph in {where['graph_on']} memory, features in a feature store {ds.features.describe()}"
    else:
        copy = f"graph in {where['graph_on']} memory, features in {where['features_on']} memory"
    say(f"dataset {ds.name}: {ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges, {ds.num_features} "
        f"features, {ds.num_classes} classes, {ds.train_idx.numel():,} training nodes; {copy} ({setup_s:.1f} s)",
        flush=True)
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, ds.num_features, cfg.hidden, ds.num_classes, len(cfg.fanouts),
                      dropout=cfg.dropout, heads=cfg.heads).to(ctx.device)
    model = wrap_ddp(net, ctx)
    # the aggregation schedules are built in the loader's thread: no host sync in the training step
    loader = _loader(cfg, ctx, ds, ds.train_idx, cfg.batch_size, cfg.seed, True, prepare=net.prepare_batch,
                     max_steps=cfg.max_batches)
    gen = torch.Generator().manual_seed(cfg.seed)

    def eval_loader(idx: torch.Tensor) -> NeighborLoader | None:
        if cfg.eval_nodes == 0 or idx.numel() == 0:
            return None
        idx = idx[torch.randperm(idx.numel(), generator=gen)[: cfg.eval_nodes]]
        return _loader(cfg, ctx, ds, idx, 4 * cfg.batch_size, cfg.seed + 1, False)

    val_loader, test_loader = eval_loader(ds.val_idx), eval_loader(ds.test_idx)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, fused=ctx.device.type == "cuda")
    loss_fn = global_mean_loss(ctx.world_size) if ctx.world_size > 1 else None
    say(f"training {cfg.model} ({len(cfg.fanouts)} layers, fanouts {list(cfg.fanouts)}, hidden {cfg.hidden}) on "
        f"{ctx.world_size} x {ctx.device.type}{f' ({ctx.backend})' if ctx.world_size > 1 else ''}, batch "
        f"{cfg.batch_size}{' per process' if ctx.world_size > 1 else ''}, {len(loader)} steps per epoch, "
        f"sampling on {loader.sample_device.type}; chance accuracy {1 / ds.num_classes:.3f}", flush=True)
    history: list[dict[str, Any]] = []
    start = 0
    if cfg.resume:  # last before the loop: it sets the random states the next epoch draws from
        start, history = checkpoint.resume_into(cfg.resume, cfg, ctx, net, opt, [loader, val_loader])
        say(f"resumed from {cfg.resume} at epoch {start} of {cfg.epochs}", flush=True)
    for epoch in range(start, cfg.epochs):
        n_steps = len(loader) if cfg.max_batches is None else min(len(loader), cfg.max_batches)
        with tqdm(total=n_steps, desc=f"epoch {epoch}", unit="batch", leave=False,
                  disable=not (cfg.progress and ctx.is_main)) as bar:
            before = ds.features.stats() if isinstance(ds.features, FeatureStore) else None
            st = train_epoch(model, loader, opt, max_batches=cfg.max_batches, progress=bar, loss_fn=loss_fn,
                             epoch=epoch, allow_nonfinite=cfg.allow_nonfinite)
        seeds = _seeds_in(loader, st.batches)
        row = {**st.as_dict(), "seeds": seeds, "seeds_per_s": seeds / st.epoch_s if st.epoch_s else 0.0}
        if before is not None:  # what the store served in this epoch's training steps
            row["feature_store"] = _stats_since(before, ds.features.stats())
        val = _accuracy(ctx, net, val_loader)
        ranks = all_gather_objects(ctx, row)
        agg = _aggregate(ranks)
        agg["val_acc"] = val
        history.append({"epoch": epoch, "aggregate": agg, "ranks": ranks})
        va = "-" if val is None else f"{val:.3f}"
        per_rank = (" (" + " + ".join(f"{r['seeds_per_s']:,.0f}" for r in ranks) + " per rank)"
                    if ctx.world_size > 1 else "")
        say(f"epoch {epoch}: loss {agg['loss']:.4f}  train acc {agg['train_acc']:.3f}  val acc {va}  time "
            f"{agg['epoch_s']:.2f} s (sample {agg['sample_s']:.2f}, gather {agg['gather_s']:.2f}, train "
            f"{agg['train_s']:.2f}, waiting for data {agg['wait_s']:.2f})  {agg['seeds_per_s']:,.0f} seeds/s{per_rank}  "
            f"CPU {agg['cpu_s']:.2f} s  peak GPU memory {_fmt_bytes(agg['peak_gpu_bytes'])}", flush=True)
        if cfg.save or cfg.resume:
            checkpoint.save_epoch(cfg.save or cfg.resume, cfg, ctx, net, opt, epoch, history)
    test = _accuracy(ctx, net, test_loader)
    if test is not None:
        say(f"test accuracy {test:.3f} (chance {1 / ds.num_classes:.3f})")
    if isinstance(ds.features, FeatureStore):
        where["feature_store_stats"] = ds.features.stats()
        say("feature store: " + ", ".join(f"{name} {st['hit_rate']:.1%} of rows ({st['bytes'] / 2**30:.2f} GiB, "
                                          f"{st['seconds']:.2f} s)" for name, st in where["feature_store_stats"].items()))
    result: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "device": str(ctx.device),
                              "backend": ctx.backend, "setup_s": setup_s, "history": history, "test_acc": test,
                              **where}
    mems: list[dict[str, Any]] = []
    if where["shared_prefix"]:
        result["memory"] = memory_footprint(ds.prefix)
        mems = all_gather_objects(ctx, result["memory"])
        if ctx.is_main:
            _report_memory(mems)
            result["memory_all_ranks"] = mems
    if ctx.is_main:
        if cfg.return_state:
            result["state"] = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        if cfg.json:
            epochs = [{**h, "ranks": [{k: v for k, v in r.items() if k != "losses"} for r in h["ranks"]]}
                      for h in history]
            doc = {"dataset": ds.name, "model": cfg.model, "world_size": ctx.world_size, "device": ctx.device.type,
                   "backend": ctx.backend, "config": asdict(cfg), "epochs": epochs, "test_acc": test, **where}
            if mems:
                doc.update(memory=mems, segment=mems[0]["segment"])
            Path(cfg.json).write_text(json.dumps(doc, indent=1, default=str))
    ctx.barrier()
    return result


def _stats_since(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-tier counters of a `FeatureStore` between two ``stats()`` (hit rates of that span)."""
    delta = {name: {k: v - before.get(name, {}).get(k, 0) for k, v in tier.items()
                    if isinstance(v, (int, float)) and k != "hit_rate"} for name, tier in after.items()}
    total = sum(t["rows"] for t in delta.values())
    for t in delta.values():
        t["hit_rate"] = t["rows"] / total if total else 0.0
    return delta


def _report_memory(mems: list[dict[str, Any]]) -> None:
    seg = mems[0]["segment"]
    print(f"host memory: shared segment {seg['nbytes'] / 2**30:.3f} GiB in {seg['tables']} tables "
          f"({seg['allocated'] / 2**30:.3f} GiB allocated), one copy for all ranks")
    for r, m in enumerate(mems):
        print(f"  rank {r}: RSS {m['rss'] / 2**30:.3f} GiB (of which shared segment "
              f"{m['shared_rss'] / 2**30:.3f}), USS {m['uss'] / 2**30:.3f} GiB, PSS {m['pss'] / 2**30:.3f} GiB "
              f"(shared segment {m['shared_pss'] / 2**30:.3f})")


def run_training(cfg: TrainConfig, nprocs: int | None = None) -> list[dict[str, Any]]:
    """Run `train` here (one process, or one rank under torchrun) or in ``nprocs`` spawned processes."""
    cfg.validate()
    if in_launched_job():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if nprocs is not None and nprocs != world:
            raise DistributedError(f"--gpus {nprocs} but this process is one of WORLD_SIZE={world} (torchrun); "
                                   f"leave --gpus out or make them agree")
        try:
            result = train(cfg)
        except Exception as exc:
            if world == 1:
                raise
            raise rank_error(int(os.environ.get("RANK", "0")), world, exc) from exc  # one line naming the rank
        else:  # leave together: a rank tearing its Gloo pairs down under a peer's last collective aborts the peer
            _leave_together()
            return [result]
        finally:
            shutdown_distributed()
    if nprocs is None:
        return [train(cfg)]
    if nprocs < 1:
        raise ValueError(f"the number of processes (--gpus) must be >= 1, got {nprocs}")
    if (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda" \
            and nprocs > torch.cuda.device_count():
        raise ValueError(f"--gpus {nprocs} but this machine has {torch.cuda.device_count()} GPUs")
    if nprocs > 1 and uses_store(cfg) and not cfg.shard_features:
        raise ValueError("--gpu-cache/--host-memory (a feature store) work in one process (or with "
                         "--shard-features); a data-parallel run shares one host copy of the features between its "
                         "processes")
    if nprocs > 1 and (cfg.features_on not in (None, "unified") or cfg.graph_on not in (None, "unified")):
        raise ValueError("with several processes the graph and features stay in one shared host copy read "
                         "zero-copy by every GPU; leave features_on/graph_on unset (or 'unified')")
    return launch(train, nprocs, (cfg,))
