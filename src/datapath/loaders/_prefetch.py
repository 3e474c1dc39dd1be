"""The loader's background producers: batches made in threads on side CUDA streams, handed over in order.

A producer knows a loader only through `BatchSteps` (``loaders/_batch_steps.py``): the callables
that make a batch (whole, or in its three stages: queue the sampling, collect the gathers, run
``prepare``) and the settings of its threads.  The threads run a `_Producer`, which holds those
steps and the queues but not the iterator the consumer holds: when the consumer drops or closes
the iterator (a ``break`` out of ``for batch in loader``), the producers are told to stop and are
joined, so no thread outlives the loop that used it.  A collective feature store's exchange runs
in a stage of its own (`ExchangeStage`, ``loaders/_exchange_stage.py``).
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any

import torch

from datapath.loaders._batch_steps import DONE, BatchSteps, Started, Stopwatch
from datapath.loaders._exchange_stage import ExchangeStage
from datapath.loaders.batch import Batch, GatherCheck
from datapath.loaders.collective_order import CollectiveOrder

SAMPLE_AHEAD = 2
"""Batches whose sampling the GPU producer keeps queued ahead of the one it prepares."""


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
        self.exchange: ExchangeStage | None = None
        # and the exchanges take turns with the consumer's collectives, in the same order on every rank
        self.order: CollectiveOrder | None = None
        if k == 1 and steps.exchange:
            self.order = CollectiveOrder(len(work), max(1, steps.depth), self.stop, phases=2)
            self.exchange = ExchangeStage(self, self.queues[0])
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
        self._put(q, DONE)

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
        self._put(q, DONE)


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
        if item is DONE:  # a worker ended early (stopped): nothing more comes in order
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
