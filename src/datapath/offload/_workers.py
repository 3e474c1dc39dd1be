"""FIFO worker threads for the store and load pools.

A job is a callable run in the worker thread.  It may return ``(event, fn)``:
a CUDA event that ends the copies it enqueued and a function to run once that
event has completed (release the GPU memory of a stored tensor, free a host
block after a load), or ``(event, fn, fail)``.  The worker keeps at most ``window``
such jobs in flight, finishes them in order as soon as their event completes, and
never sleeps while one is pending, so memory is released promptly.

An exception never ends the thread and is never only logged where the job says
how to fail: one raised by the job goes to the ``fail`` it was submitted with, one
raised while waiting for its event (a CUDA error) or by ``fn`` to the ``fail`` it
returned (else the submitted one).  ``fail(exc)`` ends the job's work as failed
(the transfers report it in the step); a job without one is logged.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("datapath.offload.workers")

Job = Callable[[], "tuple[Any, ...] | None"]
Fail = Callable[[BaseException], None]
_STOP = object()


class Worker:
    """One thread running jobs in submission order."""

    def __init__(self, name: str, window: int = 4) -> None:
        self.name = name
        self.window = window
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inflight: collections.deque[tuple[Any, Callable[[], None], Fail | None]] = collections.deque()
        self._cv = threading.Condition()
        self._outstanding = 0  # submitted jobs not yet finished (including in-flight ones)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, fail: Fail | None = None) -> None:
        """Queue ``job``; ``fail(exc)`` is called (in the worker thread) with any exception it raises."""
        with self._cv:
            self._outstanding += 1
        self._q.put((job, fail))

    def _done(self, n: int = 1) -> None:
        with self._cv:
            self._outstanding -= n
            if self._outstanding == 0:
                self._cv.notify_all()

    def _failed(self, fail: Fail | None, exc: BaseException, what: str) -> None:
        """Hand ``exc`` to the job's ``fail`` (logged where it has none, or where ``fail`` raises too)."""
        if fail is not None:
            try:
                fail(exc)
                return
            except BaseException:  # noqa: BLE001 - the worker must never die
                log.exception("%s: reporting a failed job failed", self.name)
        log.error("%s: %s failed", self.name, what, exc_info=exc)

    def _finish_oldest(self) -> None:
        ev, fn, fail = self._inflight.popleft()
        try:
            ev.synchronize()
            fn()
        except BaseException as exc:  # noqa: BLE001 - a finisher must never kill the worker
            self._failed(fail, exc, "finishing a job")
        finally:
            self._done()

    def _reap(self) -> None:
        while self._inflight:
            try:
                done = self._inflight[0][0].query()
            except BaseException:  # noqa: BLE001 - a CUDA error: synchronize raises it again, to the job's fail
                done = True
            if not done:
                return
            self._finish_oldest()

    def _run(self) -> None:
        while True:
            self._reap()
            if self._inflight:
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    self._finish_oldest()
                    continue
            else:
                job = self._q.get()
            if job is _STOP:
                while self._inflight:
                    self._finish_oldest()
                return
            fn, fail = job
            try:
                out = fn()
            except BaseException as exc:  # noqa: BLE001 - to the job's fail; the worker never dies
                self._failed(fail, exc, "a job")
                out = None
            if out is None:
                self._done()
                continue
            self._inflight.append((out[0], out[1], out[2] if len(out) > 2 else fail))
            while len(self._inflight) > self.window:
                self._finish_oldest()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._outstanding == 0, timeout)

    @property
    def idle(self) -> bool:
        with self._cv:
            return self._outstanding == 0

    def stop(self, join: bool = True, timeout: float | None = None) -> None:
        """Finish queued jobs, then end the thread (wait for it with ``join``, at most ``timeout`` seconds)."""
        self._q.put(_STOP)
        if join and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
