"""The loader's background producers: batches made in threads on side CUDA streams, handed over in order.

A producer knows a loader only through `BatchSteps`: the callables that make a batch (whole, or
in its three stages: queue the sampling, collect the gathers, run ``prepare``) and the settings
of its threads.  The threads run a `_Producer`, which holds those steps and the queues but not
the iterator the consumer holds: when the consumer drops or closes the iterator (a ``break``
out of ``for batch in loader``), the producers are told to stop and are joined, so no thread
outlives the loop that used it.
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from datapath._runtime.pinned import gpu_wait_seconds
from datapath.loaders.batch import Batch, GatherCheck
from datapath.loaders.collective_order import CollectiveOrder

SAMPLE_AHEAD = 2
"""Batches whose sampling the GPU producer keeps queued ahead of the one it prepares."""

_DONE = object()


def _on(stream: "torch.cuda.Stream | None") -> Any:
    """A context that makes ``stream`` current (nothing where it is None: the CPU, or the current stream)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


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
        exchange: the collective gathers are finished in order by a stage of their own (`_Exchange`).
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


class _Producer:
    """The producer threads' side: the batch steps, one queue per worker, and the stop flag.

    Worker ``i`` makes batches ``i, i + k, i + 2k, ...`` and puts them into queue ``i``; the
    consumer reads the queues round-robin, so batches arrive in order however many workers.
    """

    def __init__(self, steps: BatchSteps, work: list[tuple[torch.Tensor, int]], schedule: Any = None) -> None:
        self.steps = steps
        self.schedule = schedule  # the feature store's superbatches of this epoch (closed with the producer)
        self.stop = threading.Event()
        self.cuda = steps.device.type == "cuda"
        self.queue_wait_s = 0.0  # producers' time blocked on a full queue (waiting for the consumer)
        k = max(1, min(steps.workers, len(work)))
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=steps.depth) for _ in range(k)]
        self.threads = [
            threading.Thread(target=self._run, args=(i, work[i::k]), daemon=True,
                             name=f"datapath-neighbor-loader-{i}")
            for i in range(k)
        ]
        # a collective feature store: one worker hands its batches to the exchange stage, which finishes their
        # gathers (the exchange with the other ranks) in order, while the worker samples the next batches
        self.exchange: _Exchange | None = None
        # and the exchanges take turns with the consumer's collectives, in the same order on every rank
        self.order: CollectiveOrder | None = None
        if k == 1 and steps.exchange:
            self.order = CollectiveOrder(len(work), max(1, steps.depth), self.stop, phases=2)
            self.exchange = _Exchange(self, self.queues[0])
            self.threads.append(self.exchange.thread)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        """Stop the workers, drop what they queued, and join them (idempotent)."""
        self.stop.set()
        if self.order is not None:
            self.order.end()
        for q in self.queues + ([self.exchange.inbox] if self.exchange is not None else []):
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for t in self.threads:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=30)
        if self.schedule is not None:
            self.schedule.close()

    def _put(self, q: queue.Queue, item: object) -> bool:
        t0 = time.perf_counter()
        try:
            while not self.stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False
        finally:
            self.queue_wait_s += time.perf_counter() - t0  # float += under the GIL: fine for a statistic

    def _streams(self, i: int) -> tuple[torch.cuda.Stream, ...]:
        """Worker ``i``'s (sampling, gather, prepare) streams, made once per loader."""
        steps = self.steps
        streams = steps.streams.get(i)
        if streams is None:
            dev, prio = steps.device, steps.stream_priority
            # the gather stream has the lowest priority: bulk PCIe reads
            streams = (torch.cuda.Stream(dev, priority=prio), torch.cuda.Stream(dev),
                       torch.cuda.Stream(dev, priority=prio))
            steps.streams[i] = streams
        return streams

    def _run(self, i: int, work: list[tuple[torch.Tensor, int]]) -> None:
        q = self.queues[i] if self.exchange is None else self.exchange.inbox
        try:
            make = self.steps.make
            if self.cuda:
                torch.cuda.set_device(self.steps.device)
                if self.steps.gather_stream != "serial":
                    self._run_pipelined(q, work, self._streams(i))
                    return
                stream = self._streams(i)[0]
            for seeds, step in work:
                if self.stop.is_set():
                    return
                if self.cuda:
                    with torch.cuda.stream(stream):
                        batch = make(seeds, step, self.schedule, self.exchange is not None)
                else:
                    batch = make(seeds, step, self.schedule, self.exchange is not None)
                if not self._put(q, batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(q, exc)
            return
        self._put(q, _DONE)

    def _run_pipelined(self, q: queue.Queue, work: list[tuple[torch.Tensor, int]],
                       streams: tuple[torch.cuda.Stream, ...]) -> None:
        """The GPU producer: three streams, and the sampling of later batches queued before ``prepare``.

        The sampling stream samples; the gather stream reads features and labels over PCIe; the
        prepare stream runs the ``prepare`` hook.  The sampling of batch k + `SAMPLE_AHEAD` is queued
        before batch k's ``prepare`` runs on the CPU, so the one wait for a batch's sizes
        (`PendingSample.blocks`) mostly finds its kernels done instead of sleeping while they read
        the graph over PCIe.  An error of a later batch reaches the consumer after the batches
        before it.
        """
        steps = self.steps
        sample_stream, gather_stream, prepare_stream = streams
        if steps.gather_stream == "sample":
            gather_stream = sample_stream
        checks: list[GatherCheck] = []
        pending: collections.deque = collections.deque()

        def launch(j: int) -> "Started | BaseException":
            with torch.cuda.stream(sample_stream):
                try:
                    return steps.start(*work[j])
                except Exception as exc:  # noqa: BLE001 - raised when its turn comes
                    return exc

        for j in range(min(SAMPLE_AHEAD, len(work))):
            pending.append(launch(j))
        for k in range(len(work)):
            if self.stop.is_set():
                return
            while checks and checks[0].done():
                checks.pop(0).raise_if_bad()
            st = pending.popleft()
            if isinstance(st, BaseException):
                raise st
            with torch.cuda.stream(sample_stream):
                batch = steps.collect(st, gather_stream, self.schedule, self.exchange is not None)
            j = k + SAMPLE_AHEAD
            if j < len(work) and not any(isinstance(p, BaseException) for p in pending):
                sw = Stopwatch()
                nxt = launch(j)
                sw.charge(batch, "sample")  # batch j's sampling launch ran here: counted in this batch's times
                if isinstance(nxt, Started):
                    nxt.sample_s = nxt.cpu_s = nxt.wait_s = 0.0
                pending.append(nxt)
            if self.exchange is None:
                steps.prepare(batch, prepare_stream)
            if batch._check is not None:
                checks.append(batch._check)
            if not self._put(q, batch):
                return
        for c in checks:
            c.raise_if_bad()
        self._put(q, _DONE)


class _Exchange:
    """The stage that finishes a collective feature store's gathers, in batch order, on a thread of its own.

    The worker hands over each batch with its features gathered but for the rows of other ranks
    (``batch._pending``); this thread runs the exchange (host synchronisations, waits for the other
    ranks) on a CUDA stream of its own that waits only for that batch's gather, runs the ``prepare``
    hook, and passes the batch on.  Meanwhile the worker samples and gathers the next batches, so a
    rank's exchange overlaps its sampling instead of following it.  A worker's error takes its batch's
    place in the order: the other ranks learn of it in that exchange (`FeatureStore.abort`).

    Each exchange goes in two turns (`CollectiveOrder` with ``phases=2``): turn ``t`` submits the rest
    of batch ``t - 1``'s exchange, then batch ``t``'s counts (`PendingGather.start`); between turns
    ``t`` and ``t + 1`` the thread reads batch ``t``'s counts (`PendingGather.read`: the exchange's host
    synchronisation), so the consumer, which waits while a turn is submitted, never waits for that read
    inside a turn.  What a turn's collectives need and can be made without one is made between the
    turns too: batch ``t``'s ids sorted by owner before turn ``t`` (`PendingGather.prepare`), the rest's
    buffers and split sizes with the read; a turn submits the collectives and what follows them on the
    stream.  A store whose gather cannot be split (`PendingGather.prepare` is False) exchanges whole in
    the second turn.
    """

    def __init__(self, producer: _Producer, out: queue.Queue) -> None:
        self.producer = producer
        self.out = out
        self.inbox: queue.Queue = queue.Queue(maxsize=max(1, producer.steps.depth))
        self.thread = threading.Thread(target=self._run, daemon=True, name="datapath-neighbor-loader-exchange")

    def _get(self) -> object:
        while not self.producer.stop.is_set():
            try:
                return self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
        return _DONE

    def _run(self) -> None:
        p, steps = self.producer, self.producer.steps
        order = p.order
        try:
            stream = prepare_stream = None
            if p.cuda:
                torch.cuda.set_device(steps.device)
                # high priority, as the exchange group's NCCL stream: its short kernels go before the sampling's
                if -1 not in steps.streams:  # made once per loader, as the workers' streams
                    high = torch.cuda.Stream.priority_range()[1]
                    steps.streams[-1] = (torch.cuda.Stream(steps.device, priority=high),)
                stream = steps.streams[-1][0]
                prepare_stream = p._streams(0)[2] if steps.gather_stream != "serial" else None
            held: Batch | None = None  # the batch whose counts are submitted and read: the rest comes in turn t
            t = 0  # the next turn: batch t - 1's rows, then batch t's counts
            while True:
                item = self._get()
                if item is _DONE and held is None:  # stopped, or an epoch without batches
                    p._put(self.out, _DONE)
                    return
                if item is not _DONE and not isinstance(item, BaseException):
                    try:
                        self._prepare(item, stream)  # before its turn: what its counts' collective needs
                    except BaseException as exc:  # noqa: BLE001 - takes the batch's place: the others learn it in turn t
                        item = exc
                if order is not None and not order.exchange_turn(t):
                    return  # stopped while waiting for its turn
                if held is not None:
                    self._rows(held, stream)
                failed: BaseException | None = None
                if isinstance(item, BaseException):  # this batch's counts: the other ranks raise, naming this one
                    failed = item
                    if steps.abort is not None:
                        steps.abort(item)
                elif item is not _DONE:
                    try:
                        self._count(item, stream)
                    except BaseException as exc:  # noqa: BLE001 - after the batch before it
                        failed = exc
                if order is not None:
                    order.exchanged(t)
                if failed is None and item is not _DONE:
                    try:
                        self._read(item, stream)  # between two turns: the consumer may be training meanwhile
                    except BaseException as exc:  # noqa: BLE001 - every rank raises at this batch (same counts)
                        failed = exc
                if failed is not None or item is _DONE:
                    if order is not None:  # first: the consumer may wait for a later turn, the queue full
                        order.end()
                    if held is not None and not self._pass(held, stream, prepare_stream):
                        return
                    p._put(self.out, _DONE if failed is None else failed)
                    return
                if held is not None and not self._pass(held, stream, prepare_stream):
                    return
                held, t = item, t + 1
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            if order is not None:  # first: the consumer may wait for this exchange, the queue full before it
                order.end()
            p._put(self.out, exc)
        finally:
            if order is not None:  # nothing more to wait for: the end or the error comes through the queue
                order.end()

    def _pass(self, batch: Batch, stream: "torch.cuda.Stream | None",
              prepare_stream: "torch.cuda.Stream | None") -> bool:
        """Run ``prepare`` on a batch whose exchange is submitted and hand it on (False: stopped)."""
        steps = self.producer.steps
        if stream is not None and prepare_stream is None:
            with torch.cuda.stream(stream):  # after the exchange, off the training's stream
                steps.prepare(batch, None)
        else:
            steps.prepare(batch, prepare_stream)
        return self.producer._put(self.out, batch)

    @staticmethod
    def _prepare(batch: Batch, stream: torch.cuda.Stream | None) -> None:
        """What the first part of ``batch``'s exchange needs, no collective (its ids sorted by owner), on
        ``stream`` after the batch's own gather (queued ahead of the previous batch's rows, which the next turn
        submits: they wait for this gather too)."""
        pending = batch._pending
        if pending is None:
            return
        sw = Stopwatch()
        if stream is None:
            pending.prepare()
        else:
            if batch._events:  # the batch's own gather (and, before it, its sampling)
                stream.wait_event(batch._events[0])
            with torch.cuda.stream(stream):
                for t in pending.tensors():  # made on the worker's streams, read and written here
                    t.record_stream(stream)
                pending.prepare()
        sw.charge(batch, "gather")

    @staticmethod
    def _count(batch: Batch, stream: torch.cuda.Stream | None) -> None:
        """The first part of ``batch``'s exchange (its counts' collective), on ``stream`` after its preparation."""
        pending = batch._pending
        if pending is None:
            return
        sw = Stopwatch()
        with _on(stream):
            pending.start()
        sw.charge(batch, "gather")

    @staticmethod
    def _read(batch: Batch, stream: torch.cuda.Stream | None) -> None:
        """Wait for ``batch``'s counts (the exchange's host synchronisation; raises if a rank failed) and prepare
        the rest of its exchange (no collective), on ``stream``."""
        if batch._pending is not None:
            sw = Stopwatch()
            with _on(stream):
                batch._pending.read()
            sw.charge(batch, "gather")

    @staticmethod
    def _rows(batch: Batch, stream: torch.cuda.Stream | None) -> None:
        """The rest of ``batch``'s exchange (the whole of it if its gather is not split), on ``stream``."""
        pending, batch._pending = batch._pending, None
        if pending is None:
            return
        sw = Stopwatch()
        if stream is None:
            pending.finish()
        else:
            with torch.cuda.stream(stream):
                pending.finish()
                done = torch.cuda.Event(blocking=True)
                done.record()
            batch._events.append(done)
            batch._inputs = done
        sw.charge(batch, "gather")


class PrefetchIter:
    """One epoch of batches made by background threads (`_Producer`) while the consumer trains.

    Dropping the iterator (or `close`, or the end of the epoch, or an error) stops and joins its
    threads.
    """

    def __init__(self, steps: BatchSteps, work: list[tuple[torch.Tensor, int]], schedule: Any = None) -> None:
        self._producer = _Producer(steps, work, schedule)
        self._n = len(work)
        self._next = 0
        self._cuda = self._producer.cuda
        self._device = steps.device
        self._finalizer = weakref.finalize(self, _Producer.close, self._producer)
        self._producer.start()

    @property
    def queue_wait_s(self) -> float:
        """Seconds the producers spent blocked on a full queue (ahead of the consumer)."""
        return self._producer.queue_wait_s

    def __iter__(self) -> "PrefetchIter":
        return self

    def __next__(self) -> Batch:
        if self._producer.stop.is_set() or self._next >= self._n:
            self.close()
            raise StopIteration
        queues = self._producer.queues
        if self._producer.order is not None:  # the exchanges ahead are submitted before this batch's step
            self._producer.order.consumer_turn(self._next)
        item = queues[self._next % len(queues)].get()
        self._next += 1
        if item is _DONE:  # a worker ended early (stopped): nothing more comes in order
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch: Batch = item
        if self._cuda:
            cur = torch.cuda.current_stream(self._device)
            for event in batch._events:
                cur.wait_event(event)
            for t in batch.tensors():
                if t.device.type == "cuda":
                    t.record_stream(cur)
        return batch

    def close(self) -> None:
        """Stop and join the producer threads (idempotent; also when the iterator is dropped)."""
        self._finalizer()
