"""The order of a rank's collectives: a collective store's exchanges and the consumer's own (DDP's all-reduce).

A loader over a collective feature store (`datapath.features.sharded_store`) exchanges rows with
the other ranks on a process group of its own, from its exchange thread, while the thread that
takes its batches trains, running DDP's all-reduce on the default group.  NCCL asks that
operations on different communicators be submitted in the same order on every rank, and not from
two threads at once: its kernels wait for their peers, so two ranks that submitted an exchange
and an all-reduce in opposite orders can each wait for the other (a kernel spinning for its peer,
a CUDA call of the other thread that synchronises the device behind it).  Two threads that both
submit whenever they are ready make that order a matter of timing.

`CollectiveOrder` makes it a function of the batch number alone, the same on every rank.  The
exchange thread submits in numbered turns, ``turns = total + phases - 1`` of them; the consumer's
request for batch ``k`` releases the turns up to ``k + A + phases - 1`` (``A``: batches exchanged
ahead, the loader's prefetch depth) and waits until they are submitted; the exchange thread waits
for a turn's release before it submits anything of it, and submits nothing between two turns.  The
two threads take turns, so no two collectives are submitted at once either.  The consumer may issue
any collectives of its own between two requests, never while it waits in one.

With ``phases=2`` (what a loader over a sharded store uses), each batch's exchange is submitted in
two turns: turn ``t`` holds ``R(t - 1)`` then ``C(t)``, so the schedule is::

    C(0) R(0) C(1) ... R(A) C(A + 1)  [step 0]  R(A + 1) C(A + 2)  [step 1]  R(A + 2) C(A + 3)  [step 2] ...

``C(j)``: batch ``j``'s counts (its ids sorted by owner and the all_gather of the count matrix,
submitted, not waited for); ``R(j)``: the rest of its exchange (the ids and rows all_to_alls and the
scatter into the batch); ``[step k]``: what the consumer does between taking batch ``k`` and asking
for batch ``k + 1`` (forward, backward with DDP's all-reduce, the optimizer step).  The exchange
thread reads batch ``j``'s counts (the exchange's one host synchronisation) *between* turns ``j``
and ``j + 1``, while the consumer runs a step, never inside a turn: the consumer's wait covers the
submission of collectives, not a wait for the GPU (unless the exchange thread is still reading
when the consumer asks, or the first request, which releases turns ``0 .. A + 1``).  Batch ``k + A``
is complete (``R(k + A)`` submitted) when the consumer's request for batch ``k`` returns, as with
``phases=1`` (``X(0) .. X(A) [step 0] X(A + 1) [step 1] ...``, each exchange whole in one turn), and
the GPU work of the exchanges ahead still runs beside step ``k``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

_POLL_S = 0.1  # how often a waiting thread looks at the stop flag


class CollectiveOrder:
    """Turns of one epoch's exchange thread and consumer (see the module docstring).

    Args:
        total: batches of the epoch (one exchange each, in batch order).
        ahead: ``A``, batches whose exchange is complete ahead of the consumer's batch (>= 0; at most
            the queue depth between the exchange thread and the consumer, or the thread blocks on a
            full queue).
        stop: set when the epoch is abandoned: every wait returns.
        phases: turns each exchange is submitted in (1: whole; 2: its counts, then the rest in the
            next turn): the exchange thread takes ``total + phases - 1`` turns, numbered from 0.
    """

    def __init__(self, total: int, ahead: int, stop: threading.Event, phases: int = 1) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        if phases not in (1, 2):
            raise ValueError(f"phases must be 1 or 2, got {phases}")
        self.total = int(total)
        self.ahead = int(ahead)
        self.phases = int(phases)
        self.turns = self.total + self.phases - 1 if self.total else 0
        self._stop = stop
        self._cond = threading.Condition()
        self._released = -1  # turns 0..released may be submitted
        self._submitted = 0  # turns 0..submitted - 1 are submitted
        self._ended = False  # the exchange thread submits nothing more

    def _wait(self, ready: Callable[[], bool]) -> bool:
        """Wait (holding ``_cond``) until ``ready()``; False when stopped or ended first."""
        while not ready():
            if self._stop.is_set() or self._ended:
                return False
            self._cond.wait(_POLL_S)
        return True

    def exchange_turn(self, t: int) -> bool:
        """The exchange thread, before turn ``t``: wait for its release (False: stopped, submit nothing)."""
        with self._cond:
            return self._wait(lambda: self._released >= t) and not self._stop.is_set()

    def exchanged(self, t: int) -> None:
        """The exchange thread, after submitting turn ``t`` (or the failure that took its place)."""
        with self._cond:
            self._submitted = max(self._submitted, t + 1)
            self._cond.notify_all()

    def consumer_turn(self, k: int) -> None:
        """The consumer, asking for batch ``k``: release the turns up to ``k + A + phases - 1`` and wait until
        they are submitted.

        Returns early when the exchange thread ended (its error or the end reaches the consumer
        through the batch queue) or the epoch was stopped.
        """
        with self._cond:
            last = k + self.ahead + self.phases - 1
            self._released = max(self._released, last)
            self._cond.notify_all()
            target = min(last, self.turns - 1) + 1
            self._wait(lambda: self._submitted >= target)

    def end(self) -> None:
        """The exchange thread submits nothing more (the epoch's end, an error, a stop): nobody waits for it."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
