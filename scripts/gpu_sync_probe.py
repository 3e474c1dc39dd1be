"""Probe: what a gather that waits for its bounds check (``sync=True``) costs beyond its kernel, on this machine.

B1's ``dp_sync`` way times a call that queues the kernel and then blocks on an event
(``torch.cuda.Event(blocking=True)``: the thread sleeps until the GPU's interrupt).  Its cost
over the kernel is the wake-up latency of that sleep, which varies between machines.  This
times, from an idle GPU, a ~50 us kernel followed by: a blocking event's wait, a spinning
event's wait, ``torch.cuda.synchronize()``; and B1's 8K-row gathers with and without ``sync``, each
timed call after an untimed one of its own (as B1 does), the GPU's clocks kept up.

Seen on an H200 machine (2026-11-26, the probe's first form, without the untimed call): the
blocking wait 43 us over the kernel, the spinning one 11; a ``sync=True`` gather of 8K rows of
256 B 145 us at 7a83f29, 172 us at 5033d67 (the same machine, one call).

    PYTHONPATH=src:. python scripts/gpu_sync_probe.py
"""
from __future__ import annotations

import statistics

import torch

import datapath  # noqa: F401
from benchmarks._common import warm_gpu
from datapath.memory import native_launcher, pinned_empty
from datapath.unified_tensor import as_unified, gather


def _timed(fn, reps: int = 41) -> float:
    times = []
    for _ in range(reps):
        fn()  # the call before, untimed
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
    print(native_launcher(wait=True, timeout=300))  # built before anything is timed
    warm_gpu()
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
        warm_gpu()
        print(f"8K x 256 B {name}: {_timed(fn):.1f} us")


if __name__ == "__main__":
    main()
