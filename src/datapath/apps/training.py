"""Training and evaluation loops over a `NeighborLoader`, with the epoch's time breakdown.

Used by ``datapath train-gnn`` and ``benchmarks/gnn_epoch.py``.  Nothing here waits
on the GPU during an epoch (loss and accuracy accumulate on the device; train time
is measured with CUDA events read at the end), so batch preparation overlaps training.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from datapath.apps.errors import CudaAutogradUnavailableError, NonFiniteLossError
from datapath.apps.launch import exit_if_stopped
from datapath.loaders import Batch, NeighborLoader

LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]


def check_cuda_autograd() -> None:
    """Raise `CudaAutogradUnavailableError` when a CUDA backward would hit pytorch#161129."""
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is not None and acc.type != "cuda":
        raise CudaAutogradUnavailableError(
            f"CUDA training cannot run in this process: PyTorch's accelerator is {acc.type!r} (a PrivateUse1 "
            f"backend, datapath's 'unified' device, was registered), and torch {torch.__version__} then drops "
            f"the streams of CUDA autograd nodes, so backward() fails with an internal assert "
            f"(pytorch/pytorch#161129). Keep the PrivateUse1 backend unregistered in training processes "
            f"(benchmarks/gnn_epoch.py shows how) until datapath registers the device lazily."
        )


@dataclass
class EpochStats:
    """What one epoch took.

    ``epoch_s`` is wall time.  ``sample_s`` and ``gather_s`` are the producer's wall time
    in sampling and in gathering features/labels (overlapped with training when the
    loader prefetches); ``train_s`` is the forward+backward+step time (GPU time by CUDA
    events, wall time on the CPU); ``wait_s`` is how long training waited for batches.
    ``cpu_s`` is the process's CPU time (user+system, all threads).  Where the time of the
    pipeline goes: ``consumer_cpu_s`` is the training thread's CPU time in its steps;
    ``producer_cpu_s`` / ``producer_gpu_wait_s`` the loader threads' CPU time making batches and
    their sleep in host synchronisations; ``producer_queue_wait_s`` their time blocked on a full
    queue (ahead of the consumer).
    """

    batches: int
    epoch_s: float
    sample_s: float
    gather_s: float
    train_s: float
    wait_s: float
    cpu_s: float
    loss: float
    train_acc: float
    peak_gpu_bytes: int | None
    losses: list[float] = field(default_factory=list)
    consumer_cpu_s: float = 0.0
    producer_cpu_s: float = 0.0
    producer_gpu_wait_s: float = 0.0
    producer_queue_wait_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def train_epoch(model: nn.Module, loader: NeighborLoader, optimizer: torch.optim.Optimizer,
                max_batches: int | None = None, progress: Any = None, loss_fn: LossFn | None = None, *,
                epoch: int | None = None, allow_nonfinite: bool = False) -> EpochStats:
    """One epoch (or its first ``max_batches`` batches) of cross-entropy training.

    ``progress``: an optional tqdm bar, advanced once per batch.
    ``loss_fn(out, batch)``: the loss to minimise (default: mean cross-entropy of ``out``
    against ``batch.y``); data-parallel training passes its share of the global batch's mean.
    A NaN or infinite loss raises `NonFiniteLossError` naming ``epoch`` and the batch (and whether
    that batch's features were non-finite): checked at every batch on the CPU; on a GPU the flag
    stays on the device and the host reads a copy a few batches later (`_FiniteWatch`: no batch
    waits for the GPU), and at the epoch's end.  ``allow_nonfinite``: train on regardless.
    """
    cuda = loader.device.type == "cuda"
    proc = psutil.Process()
    if cuda:
        check_cuda_autograd()
        torch.cuda.synchronize(loader.device)
        torch.cuda.reset_peak_memory_stats(loader.device)
    model.train()
    dev = loader.device
    seen = 0
    # per batch, kept on the device and reduced once at the end (a step launches no bookkeeping op but the argmax)
    losses: list[torch.Tensor] = []
    predicted: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    watch = _FiniteWatch(dev)
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    sample_s = gather_s = wait_s = train_wall = consumer_cpu = producer_cpu = producer_wait = 0.0
    n = 0
    cpu0, t0 = _cpu_seconds(proc), time.perf_counter()
    it = iter(loader)
    try:
        while max_batches is None or n < max_batches:
            exit_if_stopped()  # a stop signal whose own raise was swallowed (see `exit_if_stopped`)
            tw = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                break
            tt, ct = time.perf_counter(), time.thread_time()
            wait_s += tt - tw
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            out = model(batch.blocks, batch.x)
            loss = F.cross_entropy(out, batch.y) if loss_fn is None else loss_fn(out, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if cuda:
                ev[1].record()
                events.append(ev)
            else:
                train_wall += time.perf_counter() - tt
            losses.append(loss.detach())
            if not allow_nonfinite:
                bad = watch.seen(losses)
                if bad is not None:
                    _raise_nonfinite(bad, epoch, losses, batch if bad == n else None)
            predicted.append(out.detach().argmax(1))
            targets.append(batch.y)
            seen += batch.y.numel()
            consumer_cpu += time.thread_time() - ct
            sample_s += batch.sample_s
            gather_s += batch.gather_s
            producer_cpu += batch.producer_cpu_s
            producer_wait += batch.producer_gpu_wait_s
            n += 1
            if progress is not None:
                progress.update(1)
    finally:
        queue_wait = getattr(it, "queue_wait_s", 0.0)  # before close(): its wake-up is not a wait for the consumer
        close = getattr(it, "close", None)
        if close is not None:
            close()
    if cuda:
        torch.cuda.synchronize(dev)
    loss_list = torch.stack(losses).tolist() if losses else []
    correct = int(torch.cat(predicted).eq(torch.cat(targets)).sum()) if predicted else 0
    bad = None if allow_nonfinite else _first_nonfinite(loss_list)
    if bad is not None:
        _raise_nonfinite(bad, epoch, losses, None)
    epoch_s = time.perf_counter() - t0
    cpu_s = _cpu_seconds(proc) - cpu0
    train_s = sum(a.elapsed_time(b) for a, b in events) / 1e3 if cuda else train_wall
    return EpochStats(
        batches=n, epoch_s=epoch_s, sample_s=sample_s, gather_s=gather_s, train_s=train_s, wait_s=wait_s,
        cpu_s=cpu_s, loss=math.fsum(loss_list) / max(n, 1), train_acc=correct / max(seen, 1),
        peak_gpu_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None, losses=loss_list,
        consumer_cpu_s=consumer_cpu, producer_cpu_s=producer_cpu, producer_gpu_wait_s=producer_wait,
        producer_queue_wait_s=queue_wait,
    )


NONFINITE_CHECK_EVERY = 8  # GPU batches between two copies of the device-side non-finite flag to the host


class _FiniteWatch:
    """Whether a loss of the epoch was not finite, read by the host without waiting for the GPU.

    No per-batch work: every `NONFINITE_CHECK_EVERY` batches on a GPU, whether the sum of the losses since the last
    copy is finite (it is not once one of them is not) is copied to pinned memory behind an event, and read at the first
    later batch that finds the copy done (waiting for the GPU would drain the queue of launched work that lets the
    host run ahead); on the CPU each batch's loss is read.  Found, the first non-finite batch is looked up in the
    losses (a wait, on the way to the error); the epoch's end reads every loss anyway."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host = torch.empty((), dtype=torch.bool, pin_memory=True) if self.cuda else None
        self._copied: torch.cuda.Event | None = None
        self._checked = 0  # losses covered by the copies so far

    def seen(self, losses: list[torch.Tensor]) -> int | None:
        """The first batch (0-based) whose loss in ``losses`` (0-d tensors on the device, one a batch so far) was not
        finite, where the host knows of one now; None otherwise."""
        if not self.cuda:
            return None if math.isfinite(float(losses[-1])) else len(losses) - 1
        if self._copied is not None and self._copied.query():
            self._copied = None
            if not bool(self._host):  # (a sum that overflowed while every loss is finite: None, as it should)
                return _first_nonfinite(torch.stack(losses).tolist())
        if self._copied is None and len(losses) % NONFINITE_CHECK_EVERY == 0:
            since = torch.stack(losses[self._checked:]).sum()  # every loss since the last copy: none is skipped
            self._checked = len(losses)
            self._host.copy_(torch.isfinite(since), non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return None


def _first_nonfinite(values: list[float]) -> int | None:
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


def _raise_nonfinite(index: int, epoch: int | None, losses: list[torch.Tensor], batch: Any) -> None:
    """One line: the epoch and batch (1-based) whose loss was NaN/inf, and whether its input features were."""
    value = float(losses[index]) if index < len(losses) else float("nan")
    where = f"epoch {epoch + 1}, batch {index + 1}" if epoch is not None else f"batch {index + 1}"
    why = ""
    xs = [] if batch is None or batch.x is None else list(batch.x.values()) if isinstance(batch.x, dict) else [batch.x]
    xs = [x for x in xs if x.is_floating_point()]  # (a dict: per node type, a typed batch)
    if xs:
        bad = sum(int((~torch.isfinite(x)).sum()) for x in xs)
        if bad:
            why = (f"; {bad:,} of this batch's {sum(x.numel() for x in xs):,} input feature values are NaN/inf: "
                   f"fix the features")
    raise NonFiniteLossError(f"{where}: the loss is {value} (not finite){why}; stopped (--allow-nonfinite trains on "
                             f"regardless)")


@torch.no_grad()
def evaluate(model: nn.Module, loader: NeighborLoader, max_batches: int | None = None) -> float:
    """Accuracy of ``model`` on the loader's seeds (sampled neighbourhoods, as in training)."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=loader.device)
    seen = 0
    it = iter(loader)
    try:
        for i, batch in enumerate(it):
            if max_batches is not None and i >= max_batches:
                break
            correct += (model(batch.blocks, batch.x).argmax(1) == batch.y).sum()
            seen += batch.y.numel()
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return int(correct) / max(seen, 1)


def profile_batches(model: nn.Module, loader: NeighborLoader, optimizer: torch.optim.Optimizer,
                    num_batches: int) -> dict[str, float]:
    """Mean seconds per batch of each stage, run one after the other (no overlap, synchronized).

    Returns ``{"sample_s", "gather_s", "train_s", "batches"}``.  ``gather_s`` covers the
    feature/label gather, any host-to-GPU copy of the batch and the loader's ``prepare`` hook.  Builds its own
    non-prefetching view of ``loader`` (same graph, data and sampler).
    """
    sync = NeighborLoader(loader.graph, loader.seeds, loader.sampler, loader.batch_size, loader.shuffle,
                          loader.drop_last, features=loader.features, labels=loader.labels,
                          device=loader.device, seed=loader.seed, prefetch=0, prepare=loader.prepare)
    sync.set_epoch(loader.epoch)
    cuda = loader.device.type == "cuda"
    if cuda:
        check_cuda_autograd()
    model.train()
    totals = {"sample_s": 0.0, "gather_s": 0.0, "train_s": 0.0}
    n = 0
    for batch in sync:
        if n >= num_batches:
            break
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(loader.device)
        totals["train_s"] += time.perf_counter() - t0
        totals["sample_s"] += batch.sample_s
        totals["gather_s"] += batch.gather_s
        n += 1
    return {k: v / max(n, 1) for k, v in totals.items()} | {"batches": n}
