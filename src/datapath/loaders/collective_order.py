"""The order of a rank's collectives: a collective store's exchanges and the consumer's own (DDP's all-reduce).

A loader over a collective feature store (`datapath.features.sharded_store`) exchanges rows with
the other ranks on a process group of its own, from its exchange thread, while the thread that
takes its batches trains, running DDP's all-reduce on the default group.  NCCL asks that
operations on different communicators be submitted in the same order on every rank, and not from
two threads at once: its kernels wait for their peers, so two ranks that submitted an exchange
and an all-reduce in opposite orders can each wait for the other (a kernel spinning for its peer,
a CUDA call of the other thread that synchronises the device behind it).  Two threads that both
submit whenever they are ready make that order a matter of timing.

`CollectiveOrder` makes it a function of the batch number alone, the same on every rank::

    X(0) X(1) ... X(A)  [step 0]  X(A + 1)  [step 1]  X(A + 2)  [step 2] ...

``X(j)``: batch ``j``'s exchange (all its collectives); ``[step k]``: what the consumer does between
taking batch ``k`` and asking for batch ``k + 1`` (forward, backward with DDP's all-reduce, the
optimizer step); ``A``: batches exchanged ahead (the loader's prefetch depth).  The consumer's
request for batch ``k`` releases ``X(k + A)`` and waits until it is submitted; the exchange thread
waits for that release before it submits ``X(k + A)``.  The two threads take turns, so no two
collectives are submitted at once either.  The exchange of batches ``k + 1 .. k + A`` is submitted
before step ``k`` begins, so its GPU work still runs beside step ``k``'s.  The consumer may issue
any collectives of its own between two requests, never while it waits in one.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

_POLL_S = 0.1  # how often a waiting thread looks at the stop flag


class CollectiveOrder:
    """Turns of one epoch's exchange thread and consumer (see the module docstring).

    Args:
        total: batches of the epoch (one exchange each, in batch order).
        ahead: ``A``, exchanges submitted ahead of the consumer's batch (>= 0; at most the queue
            depth between the exchange thread and the consumer, or the thread blocks on a full queue).
        stop: set when the epoch is abandoned: every wait returns.
    """

    def __init__(self, total: int, ahead: int, stop: threading.Event) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.total = int(total)
        self.ahead = int(ahead)
        self._stop = stop
        self._cond = threading.Condition()
        self._released = -1  # the exchanges of batches 0..released may be submitted
        self._submitted = 0  # the exchanges of batches 0..submitted - 1 are submitted
        self._ended = False  # the exchange thread submits nothing more

    def _wait(self, ready: Callable[[], bool]) -> bool:
        """Wait (holding ``_cond``) until ``ready()``; False when stopped or ended first."""
        while not ready():
            if self._stop.is_set() or self._ended:
                return False
            self._cond.wait(_POLL_S)
        return True

    def exchange_turn(self, j: int) -> bool:
        """The exchange thread, before batch ``j``'s exchange: wait for its release (False: stopped, submit nothing)."""
        with self._cond:
            return self._wait(lambda: self._released >= j) and not self._stop.is_set()

    def exchanged(self, j: int) -> None:
        """The exchange thread, after submitting batch ``j``'s exchange (or the failure that took its place)."""
        with self._cond:
            self._submitted = max(self._submitted, j + 1)
            self._cond.notify_all()

    def consumer_turn(self, k: int) -> None:
        """The consumer, asking for batch ``k``: release ``X(k + A)`` and wait until it is submitted.

        Returns early when the exchange thread ended (its error or the end reaches the consumer
        through the batch queue) or the epoch was stopped.
        """
        with self._cond:
            self._released = max(self._released, k + self.ahead)
            self._cond.notify_all()
            target = min(k + self.ahead, self.total - 1) + 1
            self._wait(lambda: self._submitted >= target)

    def end(self) -> None:
        """The exchange thread submits nothing more (the epoch's end, an error, a stop): nobody waits for it."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
