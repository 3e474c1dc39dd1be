"""Helpers shared by the benchmark scripts: result files, tables, timing."""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from datapath.apps import machine_info

RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR", Path(__file__).resolve().parent / "results"))


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``results/<name>.json`` with the machine description and the command line added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine_info(),
        "host_control": host_control(),
        **payload,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


_HOST_CONTROL: dict[str, float] = {}


def host_control() -> dict[str, float]:
    """This process's host speed, measured once: ns per step of a pure-Python loop and, with CUDA, us per launch
    of a tiny CUDA op (the calls queue; the GPU is not the limit).  Host-bound records (small graphs, small
    gathers, layer steps) move with it from process to process (1.5-2.2x seen on one machine): read them against it."""
    if not _HOST_CONTROL:
        t, acc = time.perf_counter(), 0
        for i in range(500_000):
            acc += i
        _HOST_CONTROL["python_loop_ns"] = (time.perf_counter() - t) / 500_000 * 1e9
        if torch.cuda.is_available():
            a = torch.ones(64, device="cuda")
            out = torch.empty_like(a)
            for _ in range(1000):
                torch.add(a, a, out=out)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5000):
                torch.add(a, a, out=out)
            _HOST_CONTROL["cuda_launch_us"] = (time.perf_counter() - t) / 5000 * 1e6
            torch.cuda.synchronize()
    return dict(_HOST_CONTROL)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print ``rows`` (dicts) as an aligned text table."""
    if not rows:
        print("(no rows)")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def bars_by_batch(records: Sequence[dict[str, Any]], key: str, series: Sequence[str], value: str, path: Any,
                  ylabel: str, title: str, hline: tuple[float, str] | None = None) -> None:
    """One group of bars per ``batch_size`` in ``records``, one bar per ``series`` (the records' ``key``), the
    height ``value``; ``hline``: (y, label) of a reference line.  Saved as a PNG at ``path``."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = sorted({r["batch_size"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        heights = [next(r[value] for r in records if r["batch_size"] == s and r[key] == name) for s in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], heights, width, label=name)
    if hline is not None:
        ax.axhline(hline[0], color="k", lw=0.8, ls="--", label=hline[1])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s} seeds" for s in sizes])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(name: str, description: str, records: list[dict[str, Any]], columns: Sequence[str], config: Any,
           plot: Callable[[list[dict[str, Any]], Path], None]) -> None:
    """A benchmark's last steps: print ``records`` as a table of ``columns``, write them as ``name``.json (with
    ``description`` and ``config``'s arguments) and plot them to ``name``.png (skipped without matplotlib)."""
    print_table(records, columns)
    path = write_result(name, {"description": description, "records": records,
                               "config": {k: str(v) for k, v in vars(config).items()}})
    print(f"wrote {path}")
    try:
        plot(records, RESULTS_DIR / f"{name}.png")
    except ImportError:
        print("matplotlib not installed: no plot")


def seconds_per_call(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls: CUDA events on the current stream where ``cuda``, else the
    wall clock.  Call it warmed up and synchronised."""
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 3, repeat: int = 10) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events (synchronising around)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def interleaved_ms(fns: dict[str, Any], reps: int, target_ms: float = 2.0, max_calls: int = 64,
                   warmup: int = 2) -> dict[str, float]:
    """Milliseconds per call of each ``fns[name]()``: median over ``reps`` rounds of the mean of a batch of
    back-to-back calls (about ``target_ms`` of work between CUDA events, after a synchronisation and one untimed
    call: the steady-state time per call a training loop sees, host cost included where it exceeds the GPU's);
    the ways alternate within a round (a fresh random order each round) so that drift and what the previous way
    left in the caches hit every way alike.  NaN for a way that fails."""
    out = {name: float("nan") for name in fns}
    live: dict[str, Any] = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            live[name] = fn
        except (RuntimeError, NotImplementedError, torch.OutOfMemoryError) as exc:
            print(f"    {name} failed: {str(exc).splitlines()[0][:140]}")
            torch.cuda.empty_cache()

    def batch(fn: Any, calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        fn()  # untimed lead call: what the previous way left in the caches is paid here, and the GPU is busy
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    names = list(live)
    calls = {n: max(1, min(max_calls, round(target_ms / max(batch(live[n], 1), 1e-3)))) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)
    for _ in range(reps):
        for n in rng.sample(names, len(names)):
            times[n].append(batch(live[n], calls[n]))
    out.update({n: statistics.median(t) for n, t in times.items()})
    return out


def wall_us_per_call(fn: Callable[[], Any], calls: int = 200, warmup: int = 10) -> float:
    """Wall microseconds per call of ``fn`` over ``calls`` back-to-back calls, synchronised at both ends: the cost
    of a step where the host is the bottleneck (a GPU-bound ``fn`` shows its GPU time instead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us_per_call(fn: Callable[[], Any], calls: int = 300, sleep_cycles: int = 200_000_000,
                     rounds: int = 5) -> float:
    """Host microseconds per call of ``fn``, the GPU kept busy (``torch.cuda._sleep``) so that the calls only queue:
    the median over ``rounds`` rounds of ``calls / rounds`` calls each (one slow round, a collection or a page
    fault, does not decide it).

    Valid for an ``fn`` of few launches: one whose launches in a round overflow the driver's launch queue blocks on
    the GPU and shows the sleep instead.
    """
    fn()
    torch.cuda.synchronize()
    per_round = max(1, calls // rounds)
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append((time.perf_counter() - t0) / per_round * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)



def index_set_count(m: int, row_bytes: int, spread_bytes: int = 256 << 20, floor: int = 4, cap: int = 256) -> int:
    """How many index sets a gather benchmark rotates through so that ``spread_bytes`` of other rows are read
    between two calls on one set.

    The GPU's L2 (50-60 MB on H100/H200) and its translation caches keep what an earlier call
    read: B1 with four sets of 8K rows of 256 B (8 MB in all) timed the kernel in the caller's
    order at 34.5 GB/s, with fresh sets at 18-24 (H200 machines, 2026-11-26).
    """
    return max(floor, min(cap, -(-spread_bytes // max(1, m * row_bytes))))


def warm_gpu(ms: float = 30.0) -> None:
    """Keep the GPU busy for ``ms`` so that its clocks are up before a measurement (they drop when idle)."""
    a = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        a @ a
        torch.cuda.synchronize()
