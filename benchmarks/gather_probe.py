"""Gather probe (GPU): how the row kernel's grid, visit order and launcher set the speed of random rows.

A diagnostic beside B1 (`benchmarks/gather.py`), public API only (`datapath.memory.gather_rows`,
`gather_config`, `cuda_alias`, `datapath.unified_tensor.as_unified`).  Random rows of a multi-GB
pinned table are limited by address translation, not PCIe; a sorted visit order helps only if
the rows in flight at once lie close together.  Modes:

- default (``--sweep``): for each row size and table size, GB/s of ``index_select`` on a CUDA view
  (sorted and unsorted indices) beside ``gather_rows`` under each grid (``threads_per_block`` x
  ``blocks_per_sm``) with pre-sorted indices and sorted in the call, then the default grid with
  each visit order (``sort_method``) and grid rule (``host_window_bytes``);
- ``--launchers``: 8K-row calls (``u[idx]``): host microseconds per call and GB/s under each
  ``gather_config.launcher`` beside ``index_select``, the rows checked against it;
- ``--state``: one sorted call of 262K rows of 512 B timed alone after each of several preludes
  (itself, an unsorted sweep, an idle GPU, a CPU gather), beside the naive ``index_select``.

Prints one line per case and writes ``$OUT/gather_probe_<mode>.json`` (or ./).

    PYTHONPATH=src:. python benchmarks/gather_probe.py [--gib 2,4,16] [--row-bytes 256,512,4096] [--rows 262144]
    PYTHONPATH=src:. python benchmarks/gather_probe.py --launchers
    PYTHONPATH=src:. python benchmarks/gather_probe.py --state
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks._common import host_us_per_call, warm_gpu
from datapath.memory import cuda_alias, gather_config, gather_rows
from datapath.unified_tensor import as_unified

GRIDS = [(256, 2), (128, 1), (64, 1), (32, 1)]
# (sort_method, host_window_bytes): the visit order and the grid rule of sorted host gathers
ORDERS = [("torch", 0), ("buckets", 0), ("buckets", 8 << 20), ("buckets", 32 << 20), ("buckets", 128 << 20)]


def time_ms(fn: Callable[[torch.Tensor], object], sets: list[torch.Tensor], reps: int = 9) -> float:
    """Median milliseconds of ``fn(s)`` between two CUDA events, ``s`` cycling over ``sets``."""
    for s in sets[:2]:
        fn(s)
    torch.cuda.synchronize()
    ts = []
    for r in range(reps):
        ts.append(one_call_ms(fn, sets[r % len(sets)]))
    return statistics.median(ts)


def one_call_ms(fn: Callable[..., object], *args: object) -> float:
    """Milliseconds of ``fn(*args)`` between two CUDA events, waited for."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(*args)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def table_buffer(gib: int) -> torch.Tensor:
    """``gib`` GiB of pinned bytes, one int64 in 512 written at random (the pages touched)."""
    buf = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    buf.view(torch.int64)[::512].random_()
    return buf


def sweep(buf: torch.Tensor, gibs: list[int], row_bytes: list[int], rows: int) -> dict:
    """Grid x (pre-sorted, sorted in the call) and visit order x grid rule, beside ``index_select``."""
    src = buf[: 1 << 30]
    dst = torch.empty_like(src, device="cuda")
    memcpy = (1 << 30) / time_ms(lambda s: dst.copy_(src, non_blocking=True), [src], reps=5) / 1e6
    del dst
    print(f"{torch.cuda.get_device_name()}: memcpy 1 GiB pinned->GPU {memcpy:.1f} GB/s", flush=True)
    recs = []
    grid0 = (gather_config.threads_per_block, gather_config.blocks_per_sm)
    order0 = (gather_config.sort_method, gather_config.host_window_bytes)
    for rb in row_bytes:
        for gib in gibs:
            n = (gib << 30) // rb
            host = as_unified(buf[: n * rb].view(n, rb))
            alias = cuda_alias(buf[: n * rb].view(n, rb))
            sets = [torch.randint(0, n, (rows,), device="cuda") for _ in range(4)]
            ssets = [s.sort().values for s in sets]
            nb = rows * rb
            rec: dict = {"row_bytes": rb, "gib": gib, "rows": rows,
                         "index_select_sorted": nb / time_ms(lambda s: torch.index_select(alias, 0, s), ssets) / 1e6,
                         "index_select": nb / time_ms(lambda s: torch.index_select(alias, 0, s), sets) / 1e6}
            for threads, per_sm in GRIDS:
                gather_config.threads_per_block, gather_config.blocks_per_sm = threads, per_sm
                try:
                    rec[f"pre_{threads}x{per_sm}"] = nb / time_ms(lambda s: gather_rows(host, s, sort=False),
                                                                  ssets) / 1e6
                    rec[f"sort_{threads}x{per_sm}"] = nb / time_ms(lambda s: gather_rows(host, s, sort=True),
                                                                   sets) / 1e6
                finally:
                    gather_config.threads_per_block, gather_config.blocks_per_sm = grid0
            for method, window in ORDERS:
                gather_config.sort_method, gather_config.host_window_bytes = method, window
                try:
                    rec[f"call_{method}_{window >> 20}M"] = nb / time_ms(lambda s: gather_rows(host, s, sort=True),
                                                                         sets) / 1e6
                    assert torch.equal(gather_rows(host, sets[1], sort=True), alias[sets[1]])
                finally:
                    gather_config.sort_method, gather_config.host_window_bytes = order0
            best = max((k for k in rec if k.startswith("pre_")), key=rec.__getitem__)
            print(f"{rb:5d} B {gib:3d} GiB: index_select sorted {rec['index_select_sorted']:.1f} unsorted "
                  f"{rec['index_select']:.1f} | " + " ".join(f"{k[4:]}:{rec[k]:.1f}/{rec['sort_' + k[4:]]:.1f}"
                                                         for k in rec if k.startswith("pre_"))
                  + f" | best {best} | " + " ".join(f"{k[5:]}:{rec[k]:.1f}" for k in rec if k.startswith("call_")),
                  flush=True)
            recs.append(rec)
    return {"memcpy_GBps": memcpy, "records": recs}


def launchers(buf: torch.Tensor, row_bytes: list[int], rows: int, reps: int = 15) -> dict:
    """``u[idx]`` under each launcher: host us per call (400 calls queued behind a GPU sleep) and GB/s."""
    recs = []
    saved = gather_config.launcher
    try:
        for rb in row_bytes:
            n = min(4 << 20, buf.numel() // rb)
            view = buf[: n * rb].view(torch.float32).view(n, rb // 4)
            u, alias = as_unified(view), cuda_alias(view)
            sets = [torch.randint(0, n, (rows,), device="cuda") for _ in range(8)]
            rec: dict = {"row_bytes": rb, "rows": rows,
                         "naive_us": host_us_per_call(lambda: torch.index_select(alias, 0, sets[0]), calls=400,
                                                      sleep_cycles=300_000_000),
                         "naive_GBps": rows * rb / time_ms(lambda s: torch.index_select(alias, 0, s), sets, reps)
                         / 1e6}
            for launcher in ("native", "driver", "cupy"):
                gather_config.launcher = launcher
                try:
                    u[sets[0]]
                except Exception as e:  # noqa: BLE001 - a launcher this machine lacks (cupy): say so, go on
                    rec[f"{launcher}_error"] = f"{type(e).__name__}: {e}"
                    continue
                rec[f"{launcher}_us"] = min(host_us_per_call(lambda: u[sets[0]], calls=400, sleep_cycles=300_000_000)
                                            for _ in range(3))
                rec[f"{launcher}_GBps"] = rows * rb / time_ms(lambda s: u[s], sets, reps) / 1e6
                rec[f"{launcher}_rows_match"] = bool(torch.equal(u[sets[1]].view(torch.int32),
                                                                 alias[sets[1]].view(torch.int32)))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
            recs.append(rec)
    finally:
        gather_config.launcher = saved
    return {"records": recs}


def state(buf: torch.Tensor, reps: int = 15) -> dict:
    """GB/s of one default (sorted) gather of 262K random 512 B rows from a 2 GiB table, timed alone, after each
    prelude; and the naive ``index_select`` after the same preludes."""
    rb, n, m = 512, (2 << 30) // 512, 262144
    host = as_unified(buf[: n * rb].view(n, rb))
    alias = cuda_alias(buf[: n * rb].view(n, rb))
    cpu = buf[: n * rb].view(n, rb)
    sets = [torch.randint(0, n, (m,), device="cuda") for _ in range(6)]
    csets = [s.cpu() for s in sets]
    out_pinned = torch.empty((m, rb), dtype=torch.uint8, pin_memory=True)
    a = torch.randn(2048, 2048, device="cuda")

    def busy() -> None:
        for _ in range(4):
            a @ a

    preludes: dict[str, Callable[[int], object]] = {
        "itself": lambda k: gather_rows(host, sets[(k + 1) % 6]),
        "unsorted_sweep": lambda k: torch.index_select(alias, 0, sets[(k + 2) % 6]),
        "idle_50ms": lambda k: time.sleep(0.05),
        "idle_then_busy": lambda k: (time.sleep(0.05), busy()),
        "cpu_gather": lambda k: torch.index_select(cpu, 0, csets[(k + 3) % 6], out=out_pinned).to(
            "cuda", non_blocking=True),
    }
    ways = {"datapath": lambda k: gather_rows(host, sets[k % 6]),
            "naive_zc": lambda k: torch.index_select(alias, 0, sets[k % 6])}
    recs = []
    warm_gpu()
    for wname, way in ways.items():
        for pname, pre in preludes.items():
            ts = []
            for k in range(reps):
                pre(k)
                ts.append(one_call_ms(way, k))
            gbps = m * rb / statistics.median(ts) / 1e6
            recs.append({"way": wname, "after": pname, "GBps": gbps})
            print(f"  {wname:>9} after {pname:>15}: {gbps:.1f} GB/s", flush=True)
    return {"records": recs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="grids and visit orders (the default)")
    mode.add_argument("--launchers", action="store_true", help="8K-row calls under each launcher")
    mode.add_argument("--state", action="store_true", help="a sorted call after each prelude")
    ap.add_argument("--gib", default="2,4,16", help="table sizes of --sweep, GiB")
    ap.add_argument("--rows", type=int, default=0, help="rows per call (--sweep: 262144; --launchers: 8192)")
    ap.add_argument("--row-bytes", default="", help="row sizes (--sweep: 256,...,4096; --launchers: 256,2048,16384)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gather_probe needs a CUDA GPU")
    sizes = [int(x) for x in args.row_bytes.split(",")] if args.row_bytes else None
    if args.launchers:
        name, doc = "launchers", launchers(table_buffer(2), sizes or [256, 2048, 16384], args.rows or 8192)
    elif args.state:
        name, doc = "state", state(table_buffer(2))
    else:
        gibs = [int(x) for x in args.gib.split(",")]
        name, doc = "sweep", sweep(table_buffer(max(gibs)), gibs, sizes or [256, 512, 1024, 2048, 4096],
                                   args.rows or 262144)
    path = os.path.join(os.environ.get("OUT", "."), f"gather_probe_{name}.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "mode": name, **doc}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
