"""What a loader's background producer needs from the loader, and what both sides share.

`BatchSteps`: the callables that make a batch (whole, or in its three stages: queue the sampling,
collect the gathers, run ``prepare``) and the settings of the producer's threads; `Started`: a
batch whose sampling is queued; `Stopwatch`: a stage's wall, CPU and sleep time, charged to the
batch; `run_prepare`: a loader's ``prepare`` hook on a batch; `DONE`: the end of a producer queue.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from datapath._runtime.pinned import gpu_wait_seconds
from datapath.loaders.batch import Batch

DONE = object()
"""Put into a producer queue after the last batch (or when stopped): nothing more comes in order."""


class Stopwatch:
    """Wall time, this thread's CPU time and its sleep in host syncs since construction (seconds)."""

    def __init__(self) -> None:
        self.t0, self.c0, self.w0 = time.perf_counter(), time.thread_time(), gpu_wait_seconds()

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def cpu(self) -> float:
        return time.thread_time() - self.c0

    def wait(self) -> float:
        return gpu_wait_seconds() - self.w0

    def charge(self, batch: Batch, stage: str) -> None:
        """Add the elapsed times to ``batch``: wall to ``batch.<stage>_s``, CPU and sleep to the producer's."""
        setattr(batch, f"{stage}_s", getattr(batch, f"{stage}_s") + self.wall())
        batch.producer_cpu_s += self.cpu()
        batch.producer_gpu_wait_s += self.wait()


@dataclass
class Started:
    """A batch whose sampling is queued (`NeighborLoader._start`)."""

    seeds: torch.Tensor
    step: int
    pending: Any
    sample_s: float
    cpu_s: float
    wait_s: float


GatherStream = Literal["sample", "own", "serial"]


@dataclass
class BatchSteps:
    """What a producer needs from a loader: the steps that make a batch, and the settings of its threads.

    Attributes:
        make: ``make(seeds, step, schedule, defer) -> Batch``: one whole batch on the current stream,
            waited for (the CPU path and ``gather_stream="serial"``).
        start: ``start(seeds, step) -> Started``: queue one batch's sampling on the current stream.
        collect: ``collect(started, gather_stream, schedule, defer) -> Batch``: wait for the sample, launch
            the feature and label gathers (on ``gather_stream`` if given, not waited for).
        prepare: ``prepare(batch, stream)``: run the ``prepare`` hook (on ``stream`` if given).
        abort: a collective feature store's ``abort(exc)`` (tells the other ranks), or None.
        device: where batches go; workers, depth: threads and batches queued ahead by each.
        gather_stream: ``"sample"`` (the gather queued on the sampling stream), ``"own"`` (a stream of its
            own) or ``"serial"`` (each batch made whole and waited for, no pipelining).
        exchange: the collective gathers are finished in order by a stage of their own (`ExchangeStage`).
        stream_priority: CUDA priority of the sampling and prepare streams.
        streams: the loader's streams per worker (``-1``: the exchange stage), kept across epochs.
    """

    make: Callable[[torch.Tensor, int, Any, bool], Batch]
    start: Callable[[torch.Tensor, int], "Started"]
    collect: Callable[["Started", "torch.cuda.Stream | None", Any, bool], Batch]
    prepare: Callable[[Batch, "torch.cuda.Stream | None"], None]
    abort: Callable[[BaseException], None] | None
    device: torch.device
    workers: int = 1
    depth: int = 1
    gather_stream: GatherStream = "sample"
    exchange: bool = False
    stream_priority: int = 0
    streams: dict[int, tuple[torch.cuda.Stream, ...]] = field(default_factory=dict)


def run_prepare(hook: Callable[[Any], Any] | None, batch: Batch, prepare_stream: "torch.cuda.Stream | None",
                device: torch.device) -> None:
    """A loader's ``prepare`` hook on ``batch`` (on ``prepare_stream`` after the batch's sampling, if given); the
    tensors it returns travel with the batch, and the consumer's stream waits for the hook's GPU work."""
    if hook is None:
        return
    sw = Stopwatch()
    if prepare_stream is not None:
        # no record_stream(prepare_stream) on the batch's tensors: the consumer's stream waits for this
        # stream's event before it uses them, and they are record_stream-ed there, so they outlive the
        # reads here (a batch dropped unhanded only has its own kernels read freed memory)
        prepare_stream.wait_event(batch._sampled)
        with torch.cuda.stream(prepare_stream):
            batch._prepared = list(hook(batch) or ())
            event = torch.cuda.Event(blocking=True)
            event.record()
    else:
        batch._prepared = list(hook(batch) or ())
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event(blocking=True)
            event.record()
    if event is not None:
        batch._events.append(event)
    sw.charge(batch, "gather")
