"""FIFO worker threads for the store and load pools.

A job is a callable run in the worker thread.  It may return ``(event, fn)``:
a CUDA event that ends the copies it enqueued and a function to run once that
event has completed (release the GPU memory of a stored tensor, free a host
block after a load).  The worker keeps at most ``window`` such jobs in flight,
finishes them in order as soon as their event completes, and never sleeps
while one is pending, so memory is released promptly.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("datapath.offload.workers")

Job = Callable[[], "tuple[Any, Callable[[], None]] | None"]
_STOP = object()


class Worker:
    """One thread running jobs in submission order."""

    def __init__(self, name: str, window: int = 4) -> None:
        self.name = name
        self.window = window
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inflight: collections.deque[tuple[Any, Callable[[], None]]] = collections.deque()
        self._cv = threading.Condition()
        self._outstanding = 0  # submitted jobs not yet finished (including in-flight ones)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._outstanding += 1
        self._q.put(job)

    def _done(self, n: int = 1) -> None:
        with self._cv:
            self._outstanding -= n
            if self._outstanding == 0:
                self._cv.notify_all()

    def _finish_oldest(self) -> None:
        ev, fn = self._inflight.popleft()
        try:
            ev.synchronize()
            fn()
        except BaseException:  # noqa: BLE001 - a finisher must never kill the worker
            log.exception("%s: finishing a job failed", self.name)
        self._done()

    def _reap(self) -> None:
        while self._inflight and self._inflight[0][0].query():
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
            try:
                out = job()
            except BaseException:  # noqa: BLE001 - jobs report their own errors; never die
                log.exception("%s: job failed", self.name)
                out = None
            if out is None:
                self._done()
                continue
            self._inflight.append(out)
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

    def stop(self, join: bool = True) -> None:
        """Finish queued jobs, then end the thread (wait for it with ``join``)."""
        self._q.put(_STOP)
        if join and threading.current_thread() is not self._thread:
            self._thread.join()
