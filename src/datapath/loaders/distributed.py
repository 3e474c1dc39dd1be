"""Data-parallel GNN training: one process per GPU over ONE shared copy of the graph and features.

    datapath train-gnn --gpus 2 --dataset products            # spawns 2 processes itself
    torchrun --nproc-per-node 2 -m datapath.cli train-gnn ...  # or under torchrun (RANK, WORLD_SIZE, LOCAL_RANK)

How the data is shared (`shared_dataset`): rank 0 builds or loads the dataset and
writes each array once into shared host memory (`datapath.unified_tensor.share`: a
file in ``/dev/shm``); after a broadcast of the table names the other ranks
`~datapath.unified_tensor.attach` the same pages and pin them for their own GPU.
No rank holds a private copy: every rank samples its batches on its GPU from the
shared graph and gathers feature rows zero-copy from the shared table.

How the seeds are split (`DistributedNeighborLoader`): ``batch_size`` is the
**per-rank** batch (as in PyTorch's DistributedSampler and the DGL/PyG multi-GPU
examples): every step the ranks shuffle the seeds identically, cut the same global
batch of ``world_size * batch_size`` seeds, and rank ``r`` takes part ``r`` of it.
Step ``i`` draws the random stream of global batch ``i``, so a run on N ranks with
per-rank batch ``b`` trains on exactly the batches of a one-process `NeighborLoader`
with batch ``N * b``; `global_mean_loss` makes the averaged DDP gradient equal to
that run's gradient (each rank's loss is its share of the global batch's mean).

Clean-up: the owner (rank 0) removes the shared files at exit, also on SIGTERM
(what `torch.multiprocessing` and torchrun send to the surviving ranks when one
fails); `launch` removes the job's tables when its processes are gone, however they
ended; tables of a killed owner (SIGKILL) are removed by the next `share`
(`datapath.unified_tensor.cleanup_stale`).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import re
import secrets
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

from datapath._runtime.errors import DatapathError
from datapath.loaders.datasets import Dataset
from datapath.loaders.graph import Graph
from datapath.loaders.loader import Batch, NeighborLoader, _PrefetchIter
from datapath.loaders.sampler import NeighborSampler

log = logging.getLogger("datapath.loaders.distributed")

PREFIX_ENV = "DATAPATH_SHARE_PREFIX"
_ARRAYS = ("indptr", "indices", "edge_ids", "features", "labels", "train_idx", "val_idx", "test_idx")


class DistributedError(DatapathError):
    """A data-parallel job could not start, or one of its processes failed."""


# -- process group -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job.

    ``device``: ``cuda:<local_rank>`` on a GPU machine, else ``cpu``; ``backend``: nccl or gloo.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op with one process)."""
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return default if v in (None, "") else int(v)
    except ValueError as exc:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from exc


def in_launched_job() -> bool:
    """True inside a process started by torchrun or `launch` (RANK, WORLD_SIZE and LOCAL_RANK are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: str | None = None, backend: str | None = None,
                     timeout_s: float = 1800.0) -> DistContext:
    """Join the job described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun's variables).

    Without them: a one-process job.  ``device``: ``"cuda"`` (GPU ``LOCAL_RANK``; NCCL)
    or ``"cpu"`` (gloo); default cuda when available.  Also makes SIGTERM exit through
    the interpreter's normal shutdown, so shared tables and offload files are removed.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise DistributedError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            from datapath._runtime import require_cuda  # noqa: PLC0415

            require_cuda("distributed training with device='cuda'")
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} "
                                   f"GPUs; start at most one process per GPU")
        from datapath.loaders._cuda_sched import use_blocking_sync  # noqa: PLC0415

        use_blocking_sync(local_rank)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = backend or ("nccl" if use_cuda else "gloo")
    _exit_on_sigterm()
    if world > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise DistributedError("MASTER_PORT is not set; start the job with torchrun or datapath's launch()")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local_rank, local_world, dev, backend)


def _exit_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise SystemExit(128 + signum)  # unwinds: finally blocks and atexit handlers run

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def shutdown_distributed() -> None:
    """Leave the process group (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(ctx: DistContext, obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (a one-element list with one process)."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


# -- launching ---------------------------------------------------------------------------------
def _entry(local_rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, port: int,
           outdir: str, prefix: str) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ[PREFIX_ENV] = prefix
    _exit_on_sigterm()
    try:
        result = fn(*args)
        with open(os.path.join(outdir, f"rank{local_rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        shutdown_distributed()


def launch(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *,
           prefix: str | None = None, grace_period: float = 10.0) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes (spawned) forming one job; return their results by rank.

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (as under torchrun; ``fn`` calls `init_distributed`) and
    ``DATAPATH_SHARE_PREFIX`` = ``prefix``, which names the job's shared tables.
    ``fn`` must be importable (a module-level function) and its result picklable.
    When a process fails, the others get ``grace_period`` seconds to finish, then
    SIGTERM, then after another ``grace_period`` SIGKILL (a rank blocked in a
    collective cannot run its SIGTERM handler); every shared table of the job is
    removed, and `DistributedError` carries the failing rank's traceback.
    """
    import torch.multiprocessing as mp  # noqa: PLC0415
    from torch.multiprocessing.spawn import ProcessException  # noqa: PLC0415

    from datapath.unified_tensor import shared_tables, unlink  # noqa: PLC0415

    if nprocs < 1:
        raise DistributedError(f"nprocs must be >= 1, got {nprocs}")
    prefix = prefix or new_prefix()
    with tempfile.TemporaryDirectory(prefix="datapath-launch-") as outdir:
        try:
            pctx = mp.start_processes(_entry, args=(fn, args, nprocs, _free_port(), outdir, prefix),
                                      nprocs=nprocs, join=False, start_method="spawn")
            while not pctx.join(grace_period=grace_period):
                pass
        except ProcessException as exc:
            raise DistributedError(_failure_report(pctx, exc, nprocs)) from None
        finally:
            for name in shared_tables():
                if name.startswith(prefix + "."):
                    unlink(name)
                    log.debug("removed shared table %s", name)
        results = []
        for r in range(nprocs):
            with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _failure_report(pctx: Any, exc: Exception, nprocs: int) -> str:
    """What every failed rank said (its traceback), the first failure first."""
    first = getattr(exc, "error_index", None)
    parts = {}
    for i, path in enumerate(getattr(pctx, "error_files", [])):
        try:
            with open(path, "rb") as f:
                parts[i] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    if first is not None and first not in parts:
        parts[first] = str(exc)
    ranks = sorted(parts, key=lambda r: (r != first, r))
    body = "".join(f"\n-- rank {r}:\n{parts[r].strip()}\n" for r in ranks)
    return (f"rank {first} of {nprocs} failed (the others were stopped); ranks that raised: "
            f"{', '.join(map(str, sorted(parts)))}{body}")


def new_prefix() -> str:
    """A fresh name prefix for one job's shared tables."""
    return f"job{os.getpid()}-{secrets.token_hex(3)}"


# -- one shared copy of the dataset --------------------------------------------------------------
@dataclass
class SharedDataset(Dataset):
    """A `Dataset` whose arrays are views of shared tables (one copy for all processes of the machine).

    The arrays are plain CPU tensors over the shared pages, pinned for this process's
    GPU while ``tables`` (the unified tensors holding the registrations) is alive.
    """

    tables: dict[str, Any] = field(default_factory=dict, repr=False)
    prefix: str = ""


def share_dataset(ds: Dataset, prefix: str) -> tuple[dict[str, Any], SharedDataset]:
    """Copy every array of ``ds`` once into shared memory, as tables ``<prefix>.<array>``.

    Returns the descriptor other processes pass to `attach_dataset` (small, picklable)
    and this process's `SharedDataset` over the shared copy.  Drop ``ds`` afterwards.
    """
    from datapath.unified_tensor import share  # noqa: PLC0415

    from datapath.loaders._placement import host_of  # noqa: PLC0415

    arrays = {"indptr": ds.graph.indptr, "indices": ds.graph.indices, "edge_ids": ds.graph.edge_ids,
              "features": ds.features, "labels": ds.labels, "train_idx": ds.train_idx, "val_idx": ds.val_idx,
              "test_idx": ds.test_idx}
    tables = {}
    try:
        for k, t in arrays.items():
            if t is not None:
                tables[k] = share(host_of(t) if t.device.type != "cuda" else t, f"{prefix}.{k}")
    except BaseException:
        from datapath.unified_tensor import unlink  # noqa: PLC0415

        for k in tables:
            unlink(f"{prefix}.{k}")
        raise
    desc = {"prefix": prefix, "name": ds.name, "num_classes": ds.num_classes, "meta": ds.meta,
            "num_src_nodes": ds.graph.num_src_nodes, "arrays": sorted(tables)}
    return desc, _wrap(desc, tables)


def attach_dataset(desc: dict[str, Any]) -> SharedDataset:
    """This process's view of the dataset shared by `share_dataset` (maps and pins, copies nothing)."""
    from datapath.unified_tensor import attach  # noqa: PLC0415

    tables = {k: attach(f"{desc['prefix']}.{k}") for k in desc["arrays"]}
    return _wrap(desc, tables)


def _wrap(desc: dict[str, Any], tables: dict[str, Any]) -> SharedDataset:
    from datapath.unified_tensor import host_tensor  # noqa: PLC0415

    h = {k: host_tensor(u) for k, u in tables.items()}
    graph = Graph(h["indptr"], h["indices"], edge_ids=h.get("edge_ids"), num_src_nodes=desc["num_src_nodes"],
                  validate=False)
    return SharedDataset(desc["name"], graph, h["features"], h["labels"], h["train_idx"], h["val_idx"],
                         h["test_idx"], desc["num_classes"], dict(desc["meta"]), tables=tables,
                         prefix=desc["prefix"])


def shared_dataset(ctx: DistContext, make: Callable[[], Dataset], prefix: str | None = None) -> SharedDataset:
    """Rank 0 calls ``make()`` and shares the result; every rank returns its view of the one shared copy.

    ``prefix`` (rank 0 only; default ``$DATAPATH_SHARE_PREFIX`` or a fresh one) names the tables.
    """
    desc = None
    err = None
    if ctx.is_main:
        try:
            ds = make()
            desc, shared = share_dataset(ds, prefix or os.environ.get(PREFIX_ENV) or new_prefix())
            del ds
            gc.collect()
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised everywhere
            err = f"{type(exc).__name__}: {exc}"
            if ctx.world_size == 1:
                raise
            log.error("rank 0 could not build and share the dataset:\n%s", traceback.format_exc())
    if ctx.world_size > 1:
        box = [(desc, err)]
        dist.broadcast_object_list(box, src=0)
        desc, err = box[0]
        if err is not None:
            raise DistributedError(f"rank 0 could not build and share the dataset: {err}")
        if not ctx.is_main:
            shared = attach_dataset(desc)
        ctx.barrier()
    mapped = _smaps_of(_table_pattern(shared.prefix))["mappings"]
    if mapped < len(shared.tables):
        from datapath.unified_tensor import shm_dir  # noqa: PLC0415

        log.warning("rank %d holds a private copy of %d of the %d shared tables: %s is not RAM-backed, and Linux "
                    "does not let a GPU pin a disk file's pages in place. Point DATAPATH_SHM_DIR at a tmpfs "
                    "(/dev/shm; docker --shm-size) to keep one copy.", ctx.rank, len(shared.tables) - mapped,
                    len(shared.tables), shm_dir())
    return shared


# -- host memory -------------------------------------------------------------------------------
def _smaps_of(pattern: re.Pattern[str]) -> dict[str, int]:
    """Rss and Pss (bytes) of this process's mappings whose path matches ``pattern`` (Linux)."""
    out = {"rss": 0, "pss": 0, "size": 0, "mappings": 0}
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return out
    match = False
    for line in text.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            match = len(head) == 6 and bool(pattern.search(head[5]))
            out["mappings"] += match
            continue
        if match and head and head[0] in ("Rss:", "Pss:", "Size:"):
            out[head[0][:-1].lower()] += int(head[1]) * 1024
    return out


def _table_pattern(prefix: str) -> re.Pattern[str]:
    """Matches the paths of the job's shared-table files (as /proc/self/smaps shows them)."""
    from datapath.unified_tensor import shm_dir  # noqa: PLC0415

    return re.compile(re.escape(os.path.join(os.path.realpath(shm_dir()), f"datapath-{prefix}.")))


def segment_bytes(prefix: str) -> dict[str, int]:
    """Size of the job's shared tables: ``nbytes`` (data) and ``allocated`` (blocks the files hold)."""
    from datapath.unified_tensor import shared_tables, shm_dir  # noqa: PLC0415

    nbytes = allocated = count = 0
    for name, info in shared_tables().items():
        if name.startswith(prefix + "."):
            count += 1
            nbytes += int(info.get("nbytes", 0))
            try:
                allocated += os.stat(shm_dir() / f"datapath-{name}.bin").st_blocks * 512
            except OSError:
                pass
    return {"tables": count, "nbytes": nbytes, "allocated": allocated}


def memory_footprint(prefix: str | None = None) -> dict[str, Any]:
    """This process's host memory (psutil ``memory_full_info``: rss, uss, pss, shared; bytes).

    With ``prefix``, also the resident (``shared_rss``) and proportional (``shared_pss``)
    bytes of its mappings of the job's shared tables, and the segment's size.
    """
    info = psutil.Process().memory_full_info()
    out: dict[str, Any] = {k: int(getattr(info, k)) for k in ("rss", "uss", "pss", "shared") if hasattr(info, k)}
    if prefix:
        m = _smaps_of(_table_pattern(prefix))
        out.update(shared_rss=m["rss"], shared_pss=m["pss"], shared_mapped=m["size"], shared_mappings=m["mappings"],
                   segment=segment_bytes(prefix))
    return out


# -- loader ------------------------------------------------------------------------------------
@dataclass
class RankBatch(Batch):
    """A `Batch` holding one rank's part of global batch number ``step`` (``global_batch_size`` seeds in all)."""

    step: int = 0
    global_batch_size: int = 0


class DistributedNeighborLoader(NeighborLoader):
    """This rank's part of every global batch: same batches, same random streams as one big loader.

    Args (beyond `NeighborLoader`'s):
        batch_size: seeds per rank per step; the global batch is ``world_size * batch_size``.
        rank, world_size: this process's place in the job.

    Every rank shuffles all seeds with the same generator (``seed``, epoch), cuts
    global batch ``i`` as a one-process loader with batch ``world_size * batch_size``
    would, and takes the ``rank``-th of its ``world_size`` near-equal parts; the
    sampler draws from the stream of step ``i`` (so a node's sampled neighbours do
    not depend on how the batch was split).  Every rank makes the same number of
    steps: a last global batch with fewer than ``world_size`` seeds is dropped.
    """

    def __init__(self, graph: Graph, seeds: torch.Tensor, sampler: NeighborSampler | list[int],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *, rank: int,
                 world_size: int, features: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 prepare: Any = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise DistributedError(f"rank {rank} must lie in [0, world_size={world_size})")
        super().__init__(graph, seeds, sampler, batch_size * world_size, shuffle, drop_last, features=features,
                         labels=labels, device=device, seed=seed, prefetch=prefetch, prepare=prepare)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.rank_batch_size = int(batch_size)

    def _global_batches(self) -> int:
        return NeighborLoader.__len__(self)

    def global_batch_size(self, i: int) -> int:
        """Seeds in global batch ``i`` (all ranks together)."""
        n = self.seeds.numel()
        return max(0, min(self.batch_size, n - i * self.batch_size))

    def __len__(self) -> int:
        g = self._global_batches()
        if g and self.global_batch_size(g - 1) < self.world_size:
            g -= 1
        return g

    def rank_batch(self, i: int) -> tuple[int, int]:
        """(offset, count) of this rank's part within global batch ``i``."""
        size = self.global_batch_size(i)
        base, extra = divmod(size, self.world_size)
        off = self.rank * base + min(self.rank, extra)
        return off, base + (self.rank < extra)

    def seeds_in(self, num_batches: int) -> int:
        """Seeds this rank trains on in the first ``num_batches`` steps of an epoch."""
        return sum(self.rank_batch(i)[1] for i in range(min(num_batches, len(self))))

    def _collect(self, st: Any, gather_stream: torch.cuda.Stream | None) -> "RankBatch":
        # every path that makes a batch (prefetch 0, the threads, the pipelined GPU producer) goes through here
        b = super()._collect(st, gather_stream)
        fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
        step = st.step
        return RankBatch(**fields, step=step, global_batch_size=self.global_batch_size(step % self._global_batches()))

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        self.epoch += 1
        order = self.seeds
        if self.shuffle:  # the same permutation as NeighborLoader's, on every rank
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = self.seeds[torch.randperm(self.seeds.numel(), generator=gen)]
        g = self._global_batches()
        work = []
        for i in range(len(self)):
            off, cnt = self.rank_batch(i)
            start = i * self.batch_size + off
            work.append((order[start:start + cnt], epoch * g + i))
        if self.prefetch == 0:
            return (self._make(b, s) for b, s in work)
        return _PrefetchIter(self, work)


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


# -- the training job --------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """One data-parallel training job (what ``datapath train-gnn --gpus N`` runs on every rank).

    ``batch_size`` is per rank (global batch = world_size x batch_size).  ``optimizer``:
    ``"adam"`` or ``"sgd"`` (momentum 0.9).  ``max_batches``: steps per epoch at most.
    ``return_state``: rank 0's result carries the final model parameters (CPU tensors).
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
    max_batches: int | None = None
    eval_nodes: int = 10_000
    memory_gb: float | None = None
    seed: int = 0
    prefetch: int = 1
    progress: bool = False
    json: str | None = None
    return_state: bool = False
    evaluate: bool = True


def _make_dataset(cfg: TrainConfig, device: torch.device) -> Callable[[], Dataset]:
    def make() -> Dataset:
        from datapath.loaders.datasets import get_dataset  # noqa: PLC0415

        gen_dev = "cpu" if cfg.dataset == "tiny" or device.type == "cpu" else str(device)
        return get_dataset(cfg.dataset, progress=cfg.progress, memory_gb=cfg.memory_gb, seed=cfg.seed,
                           device=gen_dev)
    return make


def _combined_accuracy(ctx: DistContext, acc: float, n: int) -> float:
    parts = all_gather_objects(ctx, (acc * n, n))
    return sum(a for a, _ in parts) / max(sum(c for _, c in parts), 1)


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``model`` in DistributedDataParallel (itself with one process)."""
    if ctx.world_size == 1:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise DistributedError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def train_worker(cfg: TrainConfig) -> dict[str, Any]:
    """One rank of a data-parallel GNN job; returns this rank's numbers (rank 0 also prints the summary).

    Call it in every process of a job (torchrun, or `launch`): it joins the process
    group, shares/attaches the dataset, trains with DDP and reports per-rank and
    aggregate throughput and each rank's host memory.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    from datapath.loaders._placement import placement_of  # noqa: PLC0415
    from datapath.loaders.training import evaluate, train_epoch  # noqa: PLC0415
    from datapath.nn.models import build_model  # noqa: PLC0415

    ctx = init_distributed(cfg.device)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    dev = ctx.device
    t0 = time.perf_counter()
    ds = shared_dataset(ctx, _make_dataset(cfg, dev))
    setup_s = time.perf_counter() - t0
    where = placement_of(ds.features)
    if dev.type == "cuda" and where != "unified":
        raise DistributedError(f"the shared features are in {where!r} memory, not pinned; cannot read them zero-copy")
    fanouts = list(cfg.fanouts)
    loader = DistributedNeighborLoader(ds.graph, ds.train_idx, NeighborSampler(fanouts, seed=cfg.seed),
                                       cfg.batch_size, shuffle=True, rank=ctx.rank, world_size=ctx.world_size,
                                       features=ds.features, labels=ds.labels, device=dev, seed=cfg.seed,
                                       prefetch=cfg.prefetch)
    gen = torch.Generator().manual_seed(cfg.seed)

    def eval_loader(idx: torch.Tensor) -> DistributedNeighborLoader:
        idx = idx[torch.randperm(idx.numel(), generator=gen)[: cfg.eval_nodes]]
        return DistributedNeighborLoader(ds.graph, idx, NeighborSampler(fanouts, seed=cfg.seed + 1),
                                         4 * cfg.batch_size, rank=ctx.rank, world_size=ctx.world_size,
                                         features=ds.features, labels=ds.labels, device=dev, prefetch=cfg.prefetch)

    val_loader = eval_loader(ds.val_idx) if cfg.evaluate else None
    test_loader = eval_loader(ds.test_idx) if cfg.evaluate else None
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, ds.num_features, cfg.hidden, ds.num_classes, len(fanouts), dropout=cfg.dropout,
                      heads=cfg.heads).to(dev)
    model = wrap_ddp(net, ctx)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    loss_fn = global_mean_loss(ctx.world_size)
    if ctx.is_main:
        print(f"dataset {ds.name}: {ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges, "
              f"{ds.num_features} features, {ds.num_classes} classes, {ds.train_idx.numel():,} training nodes; "
              f"one shared copy ({segment_bytes(ds.prefix)['nbytes'] / 2**30:.2f} GiB) for {ctx.world_size} "
              f"processes ({setup_s:.1f} s)", flush=True)
        print(f"training {cfg.model} ({len(fanouts)} layers, fanouts {fanouts}, hidden {cfg.hidden}) with "
              f"{ctx.world_size} x {dev.type} ({ctx.backend}), batch {cfg.batch_size} per rank = "
              f"{cfg.batch_size * ctx.world_size} global, {len(loader)} steps per epoch", flush=True)
    history = []
    for epoch in range(cfg.epochs):
        n_steps = len(loader) if cfg.max_batches is None else min(len(loader), cfg.max_batches)
        with tqdm(total=n_steps, desc=f"epoch {epoch}", unit="batch", leave=False,
                  disable=not (cfg.progress and ctx.is_main)) as bar:
            st = train_epoch(model, loader, opt, max_batches=cfg.max_batches, progress=bar, loss_fn=loss_fn)
        seeds = loader.seeds_in(st.batches)
        row = {**st.as_dict(), "seeds": seeds, "seeds_per_s": seeds / st.epoch_s if st.epoch_s else 0.0}
        val = None
        if val_loader is not None:
            val = _combined_accuracy(ctx, evaluate(net, val_loader), val_loader.seeds_in(len(val_loader)))
        ranks = all_gather_objects(ctx, row)
        agg = _aggregate(ranks)
        agg["val_acc"] = val
        history.append({"epoch": epoch, "aggregate": agg, "ranks": ranks})
        if ctx.is_main:
            va = "-" if val is None else f"{val:.3f}"
            per_rank = " + ".join(f"{r['seeds_per_s']:,.0f}" for r in ranks)
            print(f"epoch {epoch}: loss {agg['loss']:.4f}  train acc {agg['train_acc']:.3f}  val acc {va}  "
                  f"time {agg['epoch_s']:.2f} s  {agg['seeds_per_s']:,.0f} seeds/s "
                  f"({per_rank} per rank)", flush=True)
    test = None
    if test_loader is not None:
        test = _combined_accuracy(ctx, evaluate(net, test_loader), test_loader.seeds_in(len(test_loader)))
    mem = memory_footprint(ds.prefix)
    mems = all_gather_objects(ctx, mem)
    result: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "device": str(dev),
                              "backend": ctx.backend, "setup_s": setup_s, "history": history, "test_acc": test,
                              "memory": mem}
    if ctx.is_main:
        seg = mem["segment"]
        if test is not None:
            print(f"test accuracy {test:.3f} (chance {1 / ds.num_classes:.3f})")
        print(f"host memory: shared segment {seg['nbytes'] / 2**30:.3f} GiB in {seg['tables']} tables "
              f"({seg['allocated'] / 2**30:.3f} GiB allocated), one copy for all ranks")
        for r, m in enumerate(mems):
            print(f"  rank {r}: RSS {m['rss'] / 2**30:.3f} GiB (of which shared segment "
                  f"{m['shared_rss'] / 2**30:.3f}), USS {m['uss'] / 2**30:.3f} GiB, PSS {m['pss'] / 2**30:.3f} GiB "
                  f"(shared segment {m['shared_pss'] / 2**30:.3f})")
        result["memory_all_ranks"] = mems
        if cfg.return_state:
            result["state"] = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        if cfg.json:
            import json  # noqa: PLC0415

            doc = {"dataset": ds.name, "model": cfg.model, "world_size": ctx.world_size, "device": dev.type,
                   "backend": ctx.backend, "config": asdict(cfg), "epochs": history, "test_acc": test,
                   "memory": mems, "segment": seg}
            for h in doc["epochs"]:
                for r in h["ranks"]:
                    r.pop("losses", None)
            Path(cfg.json).write_text(json.dumps(doc, indent=1, default=str))
    ctx.barrier()
    return result


def _aggregate(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's numbers from the ranks' epoch rows: slowest rank's time, total seeds, weighted loss/acc."""
    seeds = sum(r["seeds"] for r in ranks)
    epoch_s = max(r["epoch_s"] for r in ranks)
    return {"epoch_s": epoch_s, "seeds": seeds, "seeds_per_s": seeds / epoch_s if epoch_s else 0.0,
            "batches": ranks[0]["batches"], "loss": sum(r["loss"] for r in ranks) / len(ranks),
            "train_acc": sum(r["train_acc"] * r["seeds"] for r in ranks) / max(seeds, 1),
            "sample_s": max(r["sample_s"] for r in ranks), "gather_s": max(r["gather_s"] for r in ranks),
            "train_s": max(r["train_s"] for r in ranks), "cpu_s": sum(r["cpu_s"] for r in ranks)}


def run_training(cfg: TrainConfig, nprocs: int | None = None) -> list[dict[str, Any]]:
    """Run `train_worker` here (under torchrun: this process is one rank) or in ``nprocs`` spawned processes."""
    if in_launched_job():
        world = _env_int("WORLD_SIZE", 1)
        if nprocs is not None and nprocs != world:
            raise DistributedError(f"--gpus {nprocs} but this process is one of WORLD_SIZE={world} (torchrun); "
                                   f"leave --gpus out or make them agree")
        try:
            return [train_worker(cfg)]
        finally:
            shutdown_distributed()
    return launch(train_worker, nprocs or 1, (cfg,))
