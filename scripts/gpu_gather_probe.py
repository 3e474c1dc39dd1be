"""Probe: how the row kernel's grid (rows in flight) sets the speed of random rows from host memory.

Random rows of a multi-GB pinned table are limited by address translation, not PCIe (B1).
A sorted visit order helps only if the rows in flight at once lie close together: the
grid-stride kernel's window of rows in flight spans (blocks x rows per block) sorted rows.
This sweeps the grid (``gather_config.threads_per_block`` x ``blocks_per_sm``) for 262K
rows of 256 B - 4 KiB from tables of 2, 4 and 16 GiB, the indices pre-sorted (the kernel
alone) and sorted in the call, beside ``index_select`` on a CUDA view of the same memory
(sorted indices); then the default grid with each visit order (``sort_method``) and grid
rule (``host_window_bytes``, 0 = off).  Prints one line per case; JSON to
``$OUT/gather_probe.json``.

Seen on an H100 (2026-11-23, this probe's first form): host memory from the CUDA
virtual-memory API (``cuMemCreate`` on a host location, 2 MiB granularity) read random
rows no faster than cudaHostAlloc memory (512 B rows, 16 GiB table: 24.5 vs 24.6 GB/s),
while ``index_select`` with sorted indices read them at 33 GB/s: a small window of rows in
flight (its one-byte loads keep ~300 rows in flight) beats a wide one.

    PYTHONPATH=src:. python scripts/gpu_gather_probe.py [--gib 2,4,16] [--row-bytes 256,512,1024,2048,4096] [--rows 262144]
    python scripts/gpu_gather_probe.py --small     # small calls: host time, GPU time, the ordering's cost
    python scripts/gpu_gather_probe.py --orders    # sorted calls: visit orders x grid rules, interleaved
    python scripts/gpu_gather_probe.py --fused     # the one-launch ordering vs four launches; small-call grids
    python scripts/gpu_gather_probe.py --state     # one sorted call after what: itself, an unsorted sweep, idle
    python scripts/gpu_gather_probe.py --blocks    # 8K-row calls: block size x blocks per SM vs index_select
    python scripts/gpu_gather_probe.py --host      # 8K-row calls: host time of each piece; launch alternatives
    python scripts/gpu_gather_probe.py --hints     # table loads with an L2 prefetch-size hint vs without
    python scripts/gpu_gather_probe.py --inflight  # small calls: few blocks (rows in flight) vs the full grid
    python scripts/gpu_gather_probe.py --sorted    # sorted calls: grid and window rule, large rows and small
    python scripts/gpu_gather_probe.py --paths     # sorted calls: u[idx] vs each step of its path vs straight
    python scripts/gpu_gather_probe.py --sort-host # host time of each piece of the ordering
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks._common import host_us_per_call as _host_us_per_call
from benchmarks._common import index_set_count, warm_gpu
from datapath.memory import cuda_alias, gather_config, gather_rows
from datapath.unified_tensor import as_unified

GRIDS = [(256, 2), (128, 1), (64, 1), (32, 1)]
# (sort_method, host_window_bytes): the visit order and the grid rule of sorted host gathers
ORDERS = [("torch", 0), ("buckets", 0), ("buckets", 8 << 20), ("buckets", 32 << 20), ("buckets", 128 << 20)]


def time_ms(fn, sets, reps: int = 9) -> float:
    for s in sets[:2]:
        fn(s)
    torch.cuda.synchronize()
    ts = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s = sets[r % len(sets)]
        a.record()
        fn(s)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def one_call_ms(fn, *args) -> float:
    """Milliseconds of ``fn(*args)`` between two CUDA events, waited for."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(*args)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def host_us_per_call(fn) -> float:
    """Host microseconds per call (400 calls behind ~0.17 s of GPU sleep)."""
    return _host_us_per_call(fn, calls=400, sleep_cycles=300_000_000)


def _gpu_ms(fn, sets, reps: int = 15) -> tuple[float, float]:
    """(ms from an idle GPU, as B1 times it; ms of GPU work alone, queued behind a busy GPU), medians."""
    idle, busy = [], []
    for r in range(reps):
        s = sets[r % len(sets)]
        for lst, pre in ((idle, False), (busy, True)):
            if pre:
                torch.cuda._sleep(2_000_000)
            lst.append(one_call_ms(fn, s))
    return statistics.median(idle), statistics.median(busy)


def small(buf: torch.Tensor) -> dict:
    """Small calls (8K rows): where datapath's time goes beside index_select's."""
    from datapath.memory import _order, _plans  # noqa: PLC0415 - a diagnostic of the private launch path

    out: dict = {"small": [], "order": []}
    for rb in (512, 1024, 2048, 4096):
        n = 4 << 20
        if n * rb > buf.numel():
            n = buf.numel() // rb
        host = as_unified(buf[: n * rb].view(torch.float32).view(n, rb // 4))
        alias = cuda_alias(buf[: n * rb].view(torch.float32).view(n, rb // 4))
        sets = [torch.randint(0, n, (8192,), device="cuda") for _ in range(4)]
        rec = {"row_bytes": rb, "rows": 8192, "table_rows": n}
        for name, fn in (("datapath", lambda i: host[i]), ("naive", lambda i: torch.index_select(alias, 0, i))):
            rec[f"{name}_idle_ms"], rec[f"{name}_busy_ms"] = _gpu_ms(fn, sets)
            rec[f"{name}_host_us"] = host_us_per_call(lambda: fn(sets[0]))
        i0 = sets[0]
        h = host._host
        tab = _plans.known_host_table(h)
        plan = tab.plan("gather", torch.int64, 2, 0, tab.w)
        o = i0.new_empty((8192, rb // 4), dtype=torch.float32)
        (_, ref), _ = _plans.current_stream(0)
        from datapath.memory.bounds import thread_flag  # noqa: PLC0415
        flag = thread_flag()
        rec["piece_new_empty_us"] = host_us_per_call(lambda: i0.new_empty((8192, rb // 4), dtype=torch.float32))
        rec["piece_launch_us"] = host_us_per_call(
            lambda: plan.launch(tab.ptr, n, i0.data_ptr(), 0, 8192, o.data_ptr(), flag.ptr, ref))
        rec["piece_gather_rows_us"] = host_us_per_call(lambda: gather_rows(host, i0))
        rec["piece_empty_kernel_us"] = host_us_per_call(lambda: torch.cuda._sleep(1))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
        out["small"].append(rec)
    for m in (65536, 262144, 1 << 20):
        x = torch.randint(0, 4 << 20, (m,), device="cuda")
        r = {"m": m}
        r["torch_sort_idle_ms"], r["torch_sort_busy_ms"] = _gpu_ms(lambda s: torch.sort(s), [x])
        r["buckets_idle_ms"], r["buckets_busy_ms"] = _gpu_ms(lambda s: _order.bucket_order(s, 4 << 20), [x])
        r["torch_sort_host_us"] = host_us_per_call(lambda: torch.sort(x))
        r["buckets_host_us"] = host_us_per_call(lambda: _order.bucket_order(x, 4 << 20))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        out["order"].append(r)
    return out


def orders(buf: torch.Tensor, reps: int = 21) -> list[dict]:
    """Sorted calls of 65K and 262K rows of 256/512 B from a 4M-row table: each visit order and grid rule, the
    ways timed in turn (rotating) so that drift hits them alike."""
    from datapath.memory import _order  # noqa: PLC0415 - a diagnostic of the private launch path

    fine = _order.bucket_shift

    def coarse(n_keys: int, m: int) -> tuple[int, int]:  # 64 KiB of 512-byte rows a bucket
        shift, _ = fine(n_keys, m)
        shift = max(shift, 7)
        return shift, ((max(n_keys, 1) - 1) >> shift) + 1

    ways = {"torch/full": ("torch", 0, fine), "buckets/full": ("buckets", 0, fine),
            "buckets/32M": ("buckets", 32 << 20, fine), "coarse/32M": ("buckets", 32 << 20, coarse),
            "coarse/full": ("buckets", 0, coarse), "buckets/128M": ("buckets", 128 << 20, fine)}
    recs = []
    saved = (gather_config.sort_method, gather_config.host_window_bytes)
    try:
        for rb in (256, 512):
            n = 4 << 20
            host = as_unified(buf[: n * rb].view(n, rb))
            for m in (65536, 262144):
                sets = [torch.randint(0, n, (m,), device="cuda") for _ in range(4)]
                times: dict[str, list[float]] = {w: [] for w in ways}
                names = list(ways)
                for r in range(reps + 2):
                    for w in names[r % len(names):] + names[:r % len(names)]:
                        method, window, shift_fn = ways[w]
                        gather_config.sort_method, gather_config.host_window_bytes = method, window
                        _order.bucket_shift = shift_fn
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        gather_rows(host, sets[r % 4], sort=True)
                        b.record()
                        b.synchronize()
                        if r >= 2:
                            times[w].append(a.elapsed_time(b))
                rec = {"row_bytes": rb, "rows": m, **{w: m * rb / statistics.median(t) / 1e6 for w, t in times.items()}}
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
                recs.append(rec)
    finally:
        gather_config.sort_method, gather_config.host_window_bytes = saved
        _order.bucket_shift = fine
    return recs


def _interleaved(ways: dict, sets: list, reps: int, next_set: bool = False,
                 after_itself: bool = False) -> dict[str, float]:
    """Median ms per way from an idle GPU (as B1 times a call), the ways timed in turn (rotating order).

    Every way of a turn gets the turn's index set, or (``next_set``) each call the next set: with
    one set a turn, all but the first way read rows whose translations the first cached.
    ``after_itself`` (as B1 does): each timed call follows an untimed call of the same way on the
    next set, so that no way inherits the state another way left.
    """
    names = list(ways)
    times: dict[str, list[float]] = {w: [] for w in names}
    k = 0
    for r in range(reps + 2):
        for w in names[r % len(names):] + names[:r % len(names)]:
            k += 1
            if after_itself:
                ways[w](sets[(k + len(sets) // 2) % len(sets)])
                torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ways[w](sets[k % len(sets) if next_set else r % len(sets)])
            b.record()
            b.synchronize()
            if r >= 2:
                times[w].append(a.elapsed_time(b))
    return {w: statistics.median(t) for w, t in times.items()}


def fused(buf: torch.Tensor, reps: int = 21) -> dict:
    """The ordering in one cooperative launch vs four launches vs torch.sort: alone (idle / busy GPU, checked),
    and in whole sorted calls beside the kernel on pre-sorted rows; then small calls under several grids."""
    from datapath.memory import _order  # noqa: PLC0415 - a diagnostic of the private launch path

    res: dict = {"order": [], "calls": [], "grid": []}
    n_keys = 4 << 20
    for m in (8192, 65536, 262144, 1 << 20):
        x = torch.randint(-n_keys, n_keys, (m,), device="cuda")
        for dt in (torch.int64, torch.int32):
            k = x.to(dt)
            shift, _ = _order.bucket_shift(n_keys, m)
            g, o = _order.bucket_order_fused(k, n_keys)
            wrapped = torch.where(k < 0, k + n_keys, k).long()
            ok = torch.equal(k[o], g) and torch.equal(torch.sort(o).values, torch.arange(m, device="cuda")) \
                and bool(((wrapped[o] >> shift).diff() >= 0).all())
            assert ok, f"fused order wrong at m={m} {dt}"
        r = {"m": m}
        for name, fn in (("torch", lambda s: torch.sort(s)), ("unfused", lambda s: _order.bucket_order(s, n_keys)),
                         ("fused", lambda s: _order.bucket_order_fused(s, n_keys))):
            r[f"{name}_idle_ms"], r[f"{name}_busy_ms"] = _gpu_ms(fn, [x])
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        res["order"].append(r)
    saved = (gather_config.sort_method, gather_config.blocks_per_sm)
    try:
        for rb, m in ((512, 262144), (1024, 262144), (256, 262144), (512, 65536), (2048, 262144)):
            n = min(4 << 20, buf.numel() // rb)
            view = buf[: n * rb].view(torch.float32).view(n, rb // 4)
            host, alias = as_unified(view), cuda_alias(view)
            sets = [torch.randint(0, n, (m,), device="cuda") for _ in range(4)]
            presorted = [torch.sort(s).values for s in sets]

            def call(method: str):
                def fn(s: torch.Tensor) -> torch.Tensor:
                    gather_config.sort_method = method
                    return gather_rows(host, s, sort=True)
                return fn

            ways = {"torch": call("torch"), "unfused": call("buckets_unfused"), "fused": call("buckets"),
                    "naive": lambda s: torch.index_select(alias, 0, s)}
            warm_gpu()
            ms = _interleaved(ways, sets, reps)
            pre = {"presorted": lambda s: gather_rows(host, s, sort=False),
                   "naive_presorted": lambda s: torch.index_select(alias, 0, s)}
            ms.update(_interleaved(pre, presorted, reps))
            gather_config.sort_method = "buckets"
            assert torch.equal(gather_rows(host, sets[1], sort=True), alias[sets[1]])
            rec = {"row_bytes": rb, "rows": m, "table_gib": n * rb / 2**30,
                   **{f"{w}_GBps": m * rb / t / 1e6 for w, t in ms.items()}}
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
            res["calls"].append(rec)
        gather_config.sort_method = saved[0]
        for rb in (512, 1024, 2048, 4096, 8192, 16384):
            n = min(4 << 20, buf.numel() // rb)
            view = buf[: n * rb].view(torch.float32).view(n, rb // 4)
            host, alias = as_unified(view), cuda_alias(view)
            for m in (8192, 65536):
                sets = [torch.randint(0, n, (m,), device="cuda") for _ in range(4)]

                def grid(per_sm: int):
                    def fn(s: torch.Tensor) -> torch.Tensor:
                        gather_config.blocks_per_sm = per_sm
                        return host[s]
                    return fn

                ways = {"naive": lambda s: torch.index_select(alias, 0, s), "bps2": grid(2), "bps4": grid(4),
                        "bps8": grid(8), "bps16": grid(16)}
                warm_gpu()
                ms = _interleaved(ways, sets, reps)
                rec = {"row_bytes": rb, "rows": m, **{f"{w}_GBps": m * rb / t / 1e6 for w, t in ms.items()}}
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
                res["grid"].append(rec)
    finally:
        gather_config.sort_method, gather_config.blocks_per_sm = saved
    return res


def _plan_call(u: torch.Tensor, cfg: tuple[int, int] | None = None, options: tuple[str, ...] = ()):
    """A call like ``u[idx]``'s fast path through a `RowPlan` of its own grid ``cfg`` (threads per block, blocks per
    SM) and compiler ``options``: settings changed for the plan alone, so that interleaved ways do not re-plan."""
    from datapath.memory import _plans  # noqa: PLC0415 - a diagnostic of the private launch path
    from datapath.memory.bounds import thread_flag  # noqa: PLC0415

    u[torch.zeros(1, dtype=torch.int64, device="cuda")]
    tab = _plans.known_host_table(u._host)
    saved = (gather_config.threads_per_block, gather_config.blocks_per_sm)
    if cfg is not None:
        gather_config.threads_per_block, gather_config.blocks_per_sm = cfg
    try:
        plan = _plans.RowPlan(f"gather_w{tab.w}_m2_i64", False, tab.row_bytes, tab.row_stride, tab.w, 2, 0, True,
                              options)
    finally:
        gather_config.threads_per_block, gather_config.blocks_per_sm = saved
    like, flag = torch.empty(0, dtype=tab.dtype, device="cuda"), thread_flag()

    def fn(s: torch.Tensor) -> torch.Tensor:
        out = like.new_empty((s.shape[0], *tab.rest))
        plan.launch(tab.ptr, tab.n_rows, s.data_ptr(), 0, s.shape[0], out.data_ptr(), flag.ptr,
                    torch._C._cuda_getCurrentRawStream(0))
        return out
    fn.plan = plan  # type: ignore[attr-defined]
    return fn


def _compare(buf: torch.Tensor, rb: int, m: int, extra, reps: int, n_sets: int = 0, check: bool = True,
             after_itself: bool = False) -> dict:
    """One case: ``m``-row calls of ``rb``-byte float32 rows from ``buf`` (as B1's tables), ``index_select`` on a
    CUDA view (``naive``) and ``u[idx]`` (``default``) beside the ways ``extra(u, sets)`` makes, timed by
    `_interleaved`, each call on the next set; prints and returns the record (GB/s per way)."""
    n = min(4 << 20, buf.numel() // rb)
    view = buf[: n * rb].view(torch.float32).view(n, rb // 4)
    host, alias = as_unified(view), cuda_alias(view)
    sets = [torch.randint(0, n, (m,), device="cuda") for _ in range(n_sets or index_set_count(m, rb))]
    ways = {"naive": lambda s: torch.index_select(alias, 0, s), "default": lambda s: host[s], **extra(host, sets)}
    if check:
        for name, fn in ways.items():
            assert torch.equal(fn(sets[0]).view(torch.int32), alias[sets[0]].view(torch.int32)), name
    warm_gpu()
    ms = _interleaved(ways, sets, reps, next_set=True, after_itself=after_itself)
    rec = {"row_bytes": rb, "rows": m, **{f"{w}_GBps": m * rb / t / 1e6 for w, t in ms.items()}}
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    return rec


def blocks(buf: torch.Tensor, reps: int = 25, row_sizes: tuple[int, ...] = (512, 1024, 2048, 4096, 16384),
           m: int = 8192) -> list[dict]:
    """``m``-row calls (caller's order) under several block sizes and grids (their own plans), beside ``u[idx]``
    (default grid) and ``index_select``."""
    cfgs = [(256, 2), (256, 4), (128, 2), (128, 4), (128, 8), (64, 8), (64, 16), (32, 16)]
    return [_compare(buf, rb, m, lambda u, _: {f"t{t}x{b}": _plan_call(u, (t, b)) for t, b in cfgs}, reps,
                     after_itself=True) for rb in row_sizes]


def inflight(buf: torch.Tensor, reps: int = 25) -> list[dict]:
    """Small calls with few blocks (few rows in flight) vs the full grid, unsorted and with pre-sorted indices,
    beside ``index_select`` and ``u[idx]``: does a small window of random rows in flight read faster?

    Seen on an H200 machine (2026-11-25): the grid changes little, pre-sorted indices a lot at
    256-512 B rows (8K rows of 256 B: 36 GB/s with 32 blocks, 23 unsorted, 22 ``index_select``).
    """
    def ways(u: torch.Tensor, sets: list) -> dict:
        sorted_of = {id(x): torch.sort(x).values for x in sets}
        out = {}
        for cap in (16, 32, 64, 128, 0):
            call = _plan_call(u)
            if cap:
                call.plan.max_blocks = cap
            out[f"cap{cap or 'full'}"] = call
            out[f"pre{cap or 'full'}"] = (lambda c: lambda i: c(sorted_of[id(i)]))(call)  # sorted beforehand
        return out
    return [_compare(buf, rb, m, ways, reps, check=False, after_itself=True)
            for m in (8192, 65536) for rb in (256, 512, 1024, 2048, 4096)]


def _sorted_call(u: torch.Tensor, m: int, cfg: tuple[int, int] | None = None, window: int | None = None,
                 min_inflight: int | None = None, alloc_first: bool = False, order_fn=None):
    """A sorted call like ``u[idx]``'s (visit order, then the row kernel through it) with its own grid ``cfg`` and
    grid rule (``host_window_bytes`` = ``window``, ``host_min_inflight_bytes`` = ``min_inflight``) for ``m`` rows:
    the grid worked out once here, so that the timed call changes no setting.  ``order_fn(keys, n_keys)``: the
    ordering (default `_order.visit_order`'s choice)."""
    from datapath.memory import _launch, _order, _plans  # noqa: PLC0415 - a diagnostic of the private launch path
    from datapath.memory.bounds import thread_flag  # noqa: PLC0415

    plan = _plan_call(u, cfg).plan
    tab = _plans.known_host_table(u._host)
    saved = (gather_config.host_window_bytes, gather_config.host_min_inflight_bytes)
    gather_config.host_window_bytes = saved[0] if window is None else window
    gather_config.host_min_inflight_bytes = saved[1] if min_inflight is None else min_inflight
    try:
        blocks = _launch.window_blocks(min(-(-m // plan.rows_per_block), plan.max_blocks), plan.rows_per_block, m,
                                       tab.n_rows * tab.row_stride, tab.row_bytes)
    finally:
        gather_config.host_window_bytes, gather_config.host_min_inflight_bytes = saved
    like, flag = torch.empty(0, dtype=tab.dtype, device="cuda"), thread_flag()
    stride, row_bytes, g = plan.static
    visit = order_fn or (lambda keys, n: _order.visit_order(keys, True, n))

    def fn(s: torch.Tensor) -> torch.Tensor:
        if alloc_first:  # the output made before the ordering (as the known-table path did)
            out = like.new_empty((s.shape[0], *tab.rest))
            keys, order = visit(s, tab.n_rows)
        else:
            keys, order = visit(s, tab.n_rows)
            out = like.new_empty((s.shape[0], *tab.rest))
        plan.driver.launch(blocks, torch._C._cuda_getCurrentRawStream(0), tab.ptr, tab.n_rows, stride, row_bytes,
                           keys.data_ptr(), order.data_ptr(), s.shape[0], out.data_ptr(), g, flag.ptr)
        return out
    fn.blocks = blocks  # type: ignore[attr-defined]
    return fn


def sorted_calls(buf: torch.Tensor, reps: int = 15) -> list[dict]:
    """Sorted calls under several grids and grid rules, beside ``u[idx]`` (the auto rule) and ``index_select``:
    large rows (2-16 KB, 65K and 262K rows; does sorting pay there, and with how many rows in flight?) and
    256 B-1 KB rows (65K, 262K; which window reads fastest) from B1's tables (4M rows, at most 16 GiB)."""
    def large(u: torch.Tensor, sets: list) -> dict:
        m = sets[0].shape[0]
        return {"sort_w32M": _sorted_call(u, m), "sort_full": _sorted_call(u, m, window=0),
                "sort_w32M_min4M": _sorted_call(u, m, min_inflight=4 << 20),
                "sort_w128M_min4M": _sorted_call(u, m, window=128 << 20, min_inflight=4 << 20),
                "t128x4_full": _sorted_call(u, m, (128, 4), window=0)}

    def small_rows(u: torch.Tensor, sets: list) -> dict:
        m = sets[0].shape[0]
        out = {f"w{w >> 20}M": _sorted_call(u, m, window=w) for w in (8 << 20, 16 << 20, 32 << 20, 64 << 20)}
        out.update(full=_sorted_call(u, m, window=0), t128x4_w32M=_sorted_call(u, m, (128, 4)),
                   t128x4_full=_sorted_call(u, m, (128, 4), window=0),
                   t512x1_w32M=_sorted_call(u, m, (512, 1)), t256x4_full=_sorted_call(u, m, (256, 4), window=0))
        for name, f in out.items():
            print(f"  {name}: {f.blocks} blocks", flush=True)
        return out

    recs = [_compare(buf, rb, m, large, reps if m * rb <= (1 << 30) else 7, after_itself=True)
            for rb in (2048, 4096, 8192, 16384) for m in (65536, 262144)]
    recs += [_compare(buf, rb, m, small_rows, 21, after_itself=True) for rb in (256, 512, 1024)
             for m in (65536, 262144)]
    return recs


def paths(buf: torch.Tensor, reps: int = 25) -> list[dict]:
    """Sorted calls (65K and 262K rows of 256/512 B): ``u[idx]`` against each step of its path
    (``gather_rows``, the known-table path) and against `_sorted_call` (the same sort, grid and kernel,
    launched straight), twice, so that a position in the turn shows as a gap between the twins; and the
    host microseconds of each (GPU kept busy)."""
    from datapath.memory import rows  # noqa: PLC0415 - a diagnostic of the private launch path

    recs = []
    for rb, m in ((256, 65536), (512, 65536), (512, 262144)):
        made: dict = {}

        def ways(u: torch.Tensor, sets: list, rb: int = rb, m: int = m) -> dict:
            made.update(u=u, s=sets[0])
            return {"gather_rows": lambda s: gather_rows(u, s),
                    "known": lambda s: rows._gather_known_unified(u, s, None, None, None),
                    "straight": _sorted_call(u, m), "straight2": _sorted_call(u, m),
                    "alloc_first": _sorted_call(u, m, alloc_first=True),
                    "default2": lambda s: u[s]}
        rec = _compare(buf, rb, m, ways, reps, after_itself=True)
        u, s = made["u"], made["s"]
        straight = _sorted_call(u, m)
        for name, f in (("default", lambda: u[s]), ("gather_rows", lambda: gather_rows(u, s)),
                        ("known", lambda: rows._gather_known_unified(u, s, None, None, None)),
                        ("straight", lambda: straight(s))):
            rec[f"{name}_host_us"] = min(host_us_per_call(f) for _ in range(3))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
        recs.append(rec)
    return recs


def sort_host(buf: torch.Tensor) -> list[dict]:
    """Host microseconds (GPU kept busy) of each piece of a sorted call's ordering, 8K and 65K int64 keys of a
    4M-row table: the bucket rule, the output allocation, the cooperative launch alone, the whole ordering (as
    tensors, `visit_order`; as addresses, `sorted_visit`), ``torch.sort``; and an empty kernel's launch.

    Seen on an H200 machine (2026-11-26, the launch through ``cuLaunchCooperativeKernel`` and tensor outputs):
    the whole ordering 15-16.5 us, of which the outputs 6.3-6.6 and the launch 6.4-6.9."""
    from datapath.memory import _order  # noqa: PLC0415 - a diagnostic of the private launch path

    del buf
    n = 4 << 20
    recs = []
    for m in (8192, 65536):
        s = torch.randint(0, n, (m,), device="cuda")
        shift, nb = _order.bucket_shift(n, m)
        fused = _order._fused_for(0, torch.int64)
        _, g_ptr, o_ptr, h_ptr = held = _order._buffer(m, nb + fused.grid_for(m), s.device)
        pieces = {"bucket_shift": lambda: _order.bucket_shift(n, m),
                  "buffer": lambda: _order._buffer(m, nb + fused.grid_for(m), s.device),
                  "torch_empty": lambda: torch.empty(2 * m, dtype=torch.int64, device="cuda"),
                  "coop_launch": lambda: fused.launch(s.data_ptr(), m, n, shift, nb, g_ptr, o_ptr, h_ptr),
                  "visit_order": lambda: _order.visit_order(s, True, n),
                  "sorted_visit": lambda: _order.sorted_visit(s, n),
                  "torch_sort": lambda: torch.sort(s),
                  "empty_kernel": lambda: torch.cuda._sleep(1)}
        rec = {"keys": m, **{f"{k}_us": min(host_us_per_call(f) for _ in range(3)) for k, f in pieces.items()}}
        del held
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
        recs.append(rec)
    return recs


def hints(buf: torch.Tensor, reps: int = 15) -> list[dict]:
    """The row kernel's table loads with and without an L2 prefetch-size hint (``DP_LOAD_HINT``), beside
    ``index_select``: does a wider L2 request read host memory faster at the PCIe limit?

    Seen on an H100 (2026-11-25): no (16 KB x 8K rows: 50.2-50.3 GB/s every way, ``index_select`` 50.25).
    """
    cases = [(256, 8192), (1024, 8192), (4096, 8192), (16384, 8192), (4096, 262144), (16384, 65536),
             (1024, 262144)]
    return [_compare(buf, rb, m, lambda u, _: {f"hint{h}": _plan_call(u, None, (f"-DDP_LOAD_HINT={h}",))
                                               for h in (0, 1, 2, 3)},
                     reps if m * rb <= (256 << 20) else 7) for rb, m in cases]


def state(buf: torch.Tensor, reps: int = 15) -> list[dict]:
    """GB/s of one default (sorted) gather of 262K random 512 B rows from a 2 GiB table, timed alone between
    events, after each of: the same call (back to back), an unsorted index_select over the same table (every
    row a new page), 50 ms of an idle GPU, 50 ms idle then 1 ms of GPU work, a CPU gather of the same rows
    (B1's ``py_pinned`` way); and the naive index_select after the same preludes."""
    import time  # noqa: PLC0415

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

    preludes = {
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
    for wname, way in ways.items():
        for pname, pre in preludes.items():
            ts = []
            for k in range(reps):
                pre(k)
                ts.append(one_call_ms(way, k))
            gbps = m * rb / statistics.median(ts) / 1e6
            recs.append({"way": wname, "after": pname, "GBps": gbps})
            print(f"  {wname:>9} after {pname:>15}: {gbps:.1f} GB/s", flush=True)
    return recs


def host_pieces(buf: torch.Tensor) -> list[dict]:
    """Host microseconds of an 8K-row call and of each piece of it, beside ``index_select``; both launchers.

    The pieces of ``u[idx]`` (UnifiedTensor.__getitem__ -> gather_rows -> the known-table path):
    the output allocation, the deferred-error read, the lookups, and the launch through
    ``cuLaunchKernelEx`` (``driver``) and through CuPy's launcher (``cupy``); then the whole call
    under each launcher, and its rows against ``index_select``'s.
    """
    from datapath.memory import _plans, rows  # noqa: PLC0415 - a diagnostic of the private launch path
    from datapath.memory.bounds import deferred_flag, thread_flag  # noqa: PLC0415

    recs = []
    saved = gather_config.launcher
    try:
        for rb in (256, 2048, 16384):
            n = min(4 << 20, buf.numel() // rb)
            view = buf[: n * rb].view(torch.float32).view(n, rb // 4)
            u, alias = as_unified(view), cuda_alias(view)
            i0 = torch.randint(0, n, (8192,), device="cuda")
            u[i0]
            torch.cuda.synchronize()
            h = u._host
            tab = _plans.known_host_table(h)
            raw = torch._C._cuda_getCurrentRawStream(0)
            fast = tab.fast_gather((torch.int64, 0, raw, gather_config.version))
            plan = fast.plan
            o = i0.new_empty((8192, rb // 4), dtype=torch.float32)
            flag = thread_flag()
            like = fast.like

            def launch() -> None:
                plan.launch_plain(tab.ptr, n, i0.data_ptr(), 8192, o.data_ptr(), flag.ptr, raw)
            plan_call = _plan_call(u)
            pieces = {
                "plan_call": lambda: plan_call(i0),
                "naive_index_select": lambda: torch.index_select(alias, 0, i0),
                "new_empty_dtype": lambda: i0.new_empty((8192, rb // 4), dtype=torch.float32),
                "like_new_empty": lambda: like.new_empty((8192, rb // 4)),
                "torch_empty": lambda: torch.empty((8192, rb // 4), dtype=torch.float32, device=i0.device),
                "deferred_flag": deferred_flag,
                "known_host_table": lambda: _plans.known_host_table(h),
                "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
                "empty_kernel": lambda: torch.cuda._sleep(1),
            }
            rec = {"row_bytes": rb, "rows": 8192}
            for name, f in pieces.items():
                rec[f"{name}_us"] = min(host_us_per_call(f) for _ in range(3))
            for launcher in ("driver", "cupy"):
                gather_config.launcher = launcher
                for name, f in (("launch", launch), ("u_getitem", lambda: u[i0]),
                                ("gather_rows", lambda: gather_rows(u, i0)),
                                ("known_unified", lambda: rows._gather_known_unified(u, i0, None, None, None))):
                    rec[f"{name}_{launcher}_us"] = min(host_us_per_call(f) for _ in range(3))
                got = u[i0]
                rec[f"rows_match_{launcher}"] = bool(torch.equal(got.view(torch.int32), alias[i0].view(torch.int32)))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
            recs.append(rec)
    finally:
        gather_config.launcher = saved
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--orders", action="store_true")
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--state", action="store_true")
    ap.add_argument("--blocks", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--hints", action="store_true")
    ap.add_argument("--inflight", action="store_true")
    ap.add_argument("--sorted", action="store_true")
    ap.add_argument("--paths", action="store_true")
    ap.add_argument("--sort-host", action="store_true")
    ap.add_argument("--gib", default="2,4,16")
    ap.add_argument("--rows", type=int, default=0, help="rows per call (default 262144; --blocks: 8192)")
    ap.add_argument("--row-bytes", default="", help="default 256,512,1024,2048,4096 (--blocks: 512-16384)")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    def dump(name: str, doc: dict) -> None:
        with open(os.path.join(os.environ.get("OUT", "."), f"gather_{name}_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), **doc}, f, indent=1)

    def table_buffer(gib: int) -> torch.Tensor:
        buf = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
        buf.view(torch.int64)[::512].random_()
        return buf

    m = args.rows or 8192
    sizes = tuple(int(x) for x in args.row_bytes.split(",")) if args.row_bytes else (512, 1024, 2048, 4096, 16384)
    modes = {"host": (2, host_pieces), "inflight": (16, inflight), "hints": (16, hints), "state": (2, state),
             "sorted": (16, sorted_calls), "paths": (2, paths),
             "sort_host": (1, sort_host),
             "blocks": (16, lambda b: blocks(b, row_sizes=sizes, m=m))}
    for name, (gib, probe) in modes.items():
        if getattr(args, name):
            dump(f"blocks_{m}" if name == "blocks" else name, {"records": probe(table_buffer(gib))})
            return
    if args.orders:
        dump("orders", {"records": orders(torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True))})
        return
    if args.fused or args.small:
        buf = torch.empty(16 << 30, dtype=torch.uint8, pin_memory=True)
        dump("fused" if args.fused else "small", fused(buf) if args.fused else small(buf))
        return
    gibs = [int(x) for x in args.gib.split(",")]
    buf = torch.empty(max(gibs) << 30, dtype=torch.uint8, pin_memory=True)
    buf.view(torch.int64)[::512].random_()
    src = buf[: 1 << 30]
    dst = torch.empty_like(src, device="cuda")
    memcpy = (1 << 30) / time_ms(lambda s: dst.copy_(src, non_blocking=True), [0], reps=5) / 1e6
    dst = None  # free the GPU copy
    print(f"{torch.cuda.get_device_name()}: memcpy 1 GiB pinned->GPU {memcpy:.1f} GB/s", flush=True)
    recs = []
    default = (gather_config.threads_per_block, gather_config.blocks_per_sm)
    args.rows = args.rows or 262144
    for rb in [int(x) for x in (args.row_bytes or "256,512,1024,2048,4096").split(",")]:
        for gib in gibs:
            n = (gib << 30) // rb
            host = as_unified(buf[: n * rb].view(n, rb))
            alias = cuda_alias(buf[: n * rb].view(n, rb))
            sets = [torch.randint(0, n, (args.rows,), device="cuda") for _ in range(4)]
            nb = args.rows * rb
            rec = {"row_bytes": rb, "gib": gib, "rows": args.rows,
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
                    gather_config.threads_per_block, gather_config.blocks_per_sm = default
            saved = (gather_config.sort_method, gather_config.host_window_bytes)
            for method, window in ORDERS:
                gather_config.sort_method, gather_config.host_window_bytes = method, window
                try:
                    rec[f"call_{method}_{window >> 20}M"] = nb / time_ms(lambda s: gather_rows(host, s, sort=True),
                                                                         sets) / 1e6
                    assert torch.equal(gather_rows(host, sets[1], sort=True), alias[sets[1]])
                finally:
                    gather_config.sort_method, gather_config.host_window_bytes = saved
            best = max((k for k in rec if k.startswith("pre_")), key=rec.__getitem__)
            print(f"{rb:5d} B {gib:3d} GiB: index_select sorted {rec['index_select_sorted']:.1f} unsorted "
                  f"{rec['index_select']:.1f} | " + " ".join(f"{k[4:]}:{rec[k]:.1f}/{rec['sort_' + k[4:]]:.1f}"
                                                         for k in rec if k.startswith("pre_"))
                  + f" | best {best} | " + " ".join(f"{k[5:]}:{rec[k]:.1f}" for k in rec if k.startswith("call_")),
                  flush=True)
            recs.append(rec)
    with open(os.path.join(os.environ.get("OUT", "."), "gather_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "memcpy_GBps": memcpy, "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
