"""The exchange stage: a collective feature store's gathers finished in batch order, on a thread of its own.

`ExchangeStage` takes the batches of the producer's one worker, runs their exchange with the other
ranks in turns (`CollectiveOrder`, ``phases=2``) that alternate with the consumer's collectives,
runs the ``prepare`` hook and hands each batch on to the consumer's queue.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Protocol

import torch

from datapath.loaders._batch_steps import DONE, BatchSteps, Stopwatch
from datapath.loaders.batch import Batch
from datapath.loaders.collective_order import CollectiveOrder


class ProducerSide(Protocol):
    """What the exchange stage uses of its producer (`loaders/_prefetch.py`'s ``_Producer``, which imports this
    module): the batch steps, the stop flag, the collectives' order, and its queue put and streams."""

    steps: BatchSteps
    stop: threading.Event
    order: CollectiveOrder | None
    cuda: bool

    def _put(self, q: queue.Queue, item: object) -> bool: ...

    def _streams(self, i: int) -> tuple[torch.cuda.Stream, ...]: ...


def _on(stream: "torch.cuda.Stream | None") -> Any:
    """A context that makes ``stream`` current (nothing where it is None: the CPU, or the current stream)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class ExchangeStage:
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

    def __init__(self, producer: ProducerSide, out: queue.Queue) -> None:
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
        return DONE

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
                if item is DONE and held is None:  # stopped, or an epoch without batches
                    p._put(self.out, DONE)
                    return
                if item is not DONE and not isinstance(item, BaseException):
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
                elif item is not DONE:
                    try:
                        self._count(item, stream)
                    except BaseException as exc:  # noqa: BLE001 - after the batch before it
                        failed = exc
                if order is not None:
                    order.exchanged(t)
                if failed is None and item is not DONE:
                    try:
                        self._read(item, stream)  # between two turns: the consumer may be training meanwhile
                    except BaseException as exc:  # noqa: BLE001 - every rank raises at this batch (same counts)
                        failed = exc
                if failed is not None or item is DONE:
                    if order is not None:  # first: the consumer may wait for a later turn, the queue full
                        order.end()
                    if held is not None and not self._pass(held, stream, prepare_stream):
                        return
                    p._put(self.out, DONE if failed is None else failed)
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
