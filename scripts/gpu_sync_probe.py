"""Probe: what a gather that waits for its bounds check (``sync=True``) costs beyond its kernel, on this machine.

B1's ``dp_sync`` way times a call that queues the kernel and then blocks on an event
(``torch.cuda.Event(blocking=True)``: the thread sleeps until the GPU's interrupt).  Its cost
over the kernel is the wake-up latency of that sleep, which varies between machines.  This
times, from an idle GPU, a ~50 us kernel followed by: a blocking event's wait, a spinning
event's wait, ``torch.cuda.synchronize()``; and B1's 8K-row gathers with and without ``sync``.

    PYTHONPATH=src:. python scripts/gpu_sync_probe.py
"""
from __future__ import annotations

import statistics

import torch

import datapath  # noqa: F401
from datapath.memory import pinned_empty
from datapath.unified_tensor import as_unified, gather


def _timed(fn, reps: int = 41) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    cycles = 100_000  # ~50 us at ~2 GHz
    print(f"kernel alone: {_timed(lambda: torch.cuda._sleep(cycles)):.1f} us")
    for name, blocking in (("blocking event", True), ("spinning event", False)):
        def wait(blocking: bool = blocking) -> None:
            torch.cuda._sleep(cycles)
            ev = torch.cuda.Event(blocking=blocking)
            ev.record()
            ev.synchronize()
        print(f"kernel + {name} wait: {_timed(wait):.1f} us")
    print(f"kernel + torch.cuda.synchronize: {_timed(lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize())):.1f} us")
    n, width = 4 << 20, 64
    table = pinned_empty((n, width), torch.float32)
    table.random_()
    u = as_unified(table)
    sets = [torch.randint(0, n, (8192,), device="cuda") for _ in range(64)]
    turn = [0]

    def nxt() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(sets)
        return sets[turn[0]]

    for name, fn in (("u[idx]", lambda: u[nxt()]), ("gather sync=True", lambda: gather(u, nxt(), sync=True))):
        fn()
        print(f"8K x 256 B {name}: {_timed(fn):.1f} us")


if __name__ == "__main__":
    main()
