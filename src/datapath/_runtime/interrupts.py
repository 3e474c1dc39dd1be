"""Long work that a Ctrl-C or SIGTERM stops within a fraction of a second.

Python runs signal handlers only in the main thread, between bytecodes: a signal that arrives
while the main thread waits for worker threads, or runs one long C call, takes effect when the
wait or the call ends.  `run_chunks` runs chunks of work on a few threads while the main thread
waits in short, interruptible steps; once interrupted it sets a stop event that the chunks read
between pieces of their work (`check`), waits for them to stop (a piece is short), and re-raises.
No thread is abandoned, so the process then exits normally.

`terminate_raises` turns SIGTERM into a `Terminated` exception for the duration of a block, so
that ``finally`` clauses and ``except BaseException`` clean-ups run as they do for Ctrl-C.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.05


class Terminated(BaseException):
    """SIGTERM arrived inside a `terminate_raises` block (exit status 143 by convention)."""

    exit_code = 128 + signal.SIGTERM


class Stopped(Exception):
    """A chunk of `run_chunks` work saw its stop event set (the caller was interrupted)."""


def check(stop: threading.Event | None) -> None:
    """Raise `Stopped` when ``stop`` is set: call it between pieces of a chunk's work."""
    if stop is not None and stop.is_set():
        raise Stopped


def run_chunks(fn: Callable[[int, threading.Event], None], n: int, workers: int | None = None,
               on_done: Callable[[], None] | None = None) -> None:
    """``fn(i, stop)`` for i in range(n) on ``workers`` threads (default: the CPU count); the first error is
    raised.  An interrupt of the calling thread (Ctrl-C, `Terminated`) sets ``stop``: no further chunk starts,
    the running ones end at their next `check`, and the interrupt is re-raised.  ``on_done`` is called in the
    calling thread after each chunk."""
    workers = max(1, min(n, workers or os.cpu_count() or 1))
    stop = threading.Event()
    todo = iter(range(n))
    lock = threading.Lock()
    out: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def work() -> None:
        while not stop.is_set():
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                fn(i, stop)
            except Stopped:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                out.put(exc)
                return
            out.put(None)

    threads = [threading.Thread(target=work, name=f"datapath-chunks-{k}", daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    try:
        for _ in range(n):
            exc = _wait(out)
            if exc is not None:
                raise exc
            if on_done is not None:
                on_done()
    finally:
        stop.set()
        for t in threads:
            t.join()


def _wait(out: "queue.SimpleQueue[BaseException | None]") -> BaseException | None:
    while True:
        try:
            return out.get(timeout=_POLL_S)
        except queue.Empty:
            continue


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Within the block (main thread only), SIGTERM raises `Terminated` in the main thread instead of killing
    the process, so clean-ups run; the previous handler comes back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
