"""B1: random row gather from a host table into GPU memory, unified tensor vs the PyTorch ways.

Ways (BENCHMARKS.md, B1):
  py           feats[idx_cpu].to("cuda")                       CPU gather + pageable copy
  py_pinned    index_select(feats, 0, idx, out=pinned) + copy  CPU gather + pinned DMA
  naive_zc     index_select on a CUDA alias of pinned memory   zero copy, no alignment care
  datapath     feats_unified[idx_cuda]                          the default: our kernel (circular shift,
                                                                short rows several per warp), rows visited
                                                                in sorted order by the auto rule, bounds
                                                                check not waited for (raised later);
                                                                calls in the caller's order launched by the
                                                                native launcher (built before the timing)
  dp_sync      the same, waiting for the bounds check (sync=True)
  dp_sort / dp_nosort   the default with the visit order forced (sorted / caller's order)
  dp_shiftmask / dp_unaligned                                  the ablation schemes (alignment sweep)
  ideal        bytes / pinned cudaMemcpy bandwidth measured in this run

Tables have N = 4M rows (BENCHMARKS.md: N >= 4M) except where the 16 GiB pinned buffer
holds fewer (8 KB rows: 2M, 16 KB rows: 1M); a last sweep varies the table size (1-16 GiB).
Within a configuration the ways are timed in turn, in rotating order, after the GPU has
been kept busy (its clocks drop while it idles), each timed call right after an untimed one
of the same way (steady state, as in a loader's loop); each reports its median.

Run:  PYTHONPATH=src:. python benchmarks/gather.py [--quick]
      (--row-sizes/--counts/--table-gib/--no-align/--no-py pick a subset; --huge-tables adds the table
      sweep from a buffer on 2 MiB pages; --name writes results/<name>.json instead)
Writes benchmarks/results/gather.json and gather.png.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import datapath  # noqa: F401  (registers the unified device)
from benchmarks._common import (
    RESULTS_DIR, cuda_time_ms, host_us_per_call, index_set_count, print_table, warm_gpu, write_result,
)
from datapath.apps.machine import device_label, require_cuda
from datapath.memory import cuda_alias, gather_config, native_launcher, pinned_empty
from datapath.unified_tensor import as_unified, check_errors, gather


def _fill(buf: torch.Tensor) -> None:
    """Fill a large pinned buffer with random bytes fast (random blocks made on the GPU, copied down)."""
    flat = buf.view(torch.uint8).view(-1)
    step = 1 << 28
    block = torch.randint(0, 256, (min(flat.numel(), step),), dtype=torch.uint8, device="cuda")
    for start in range(0, flat.numel(), step):
        n = min(step, flat.numel() - start)
        flat[start:start + n].copy_(block[:n], non_blocking=True)
        block = block.roll(4099)  # different bytes in every block
    torch.cuda.synchronize()


def _interleaved_ms(fns: dict[str, list], next_set: Any, reps: int, warm: int) -> dict[str, float]:
    """Median ms per way, the ways timed in turn (rotating order) so that drift hits them alike.

    Each timed call follows an untimed call of the same way on another index set (as in a
    loader's loop, where a batch's gather follows the last batch's), then the timing starts on
    an idle GPU.  A call's speed depends on what ran just before it: in a rotation without the
    untimed call, a sorted gather timed right after ``index_select`` read 2-6% slower than the
    same call timed after another sorted one (an H200; see the CHANGELOG).
    """
    names = list(fns)
    for name in names:
        for _ in range(warm):
            fns[name][next_set()]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fns[name][next_set()]()  # the call before, untimed
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name][next_set()]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {n: statistics.median(v) for n, v in times.items()}


def _memcpy_gbps(buf: torch.Tensor, nbytes: int) -> float:
    src = buf.view(torch.uint8).view(-1)[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = cuda_time_ms(lambda: dst.copy_(src, non_blocking=True), warmup=2, repeat=5)
    return nbytes / ms / 1e6


def _ways(table: torch.Tensor, sets: list[torch.Tensor], sets_cuda: list[torch.Tensor],
          include_py: bool, ablation: bool) -> dict[str, list]:
    """For each way, one callable per index set."""
    unified = as_unified(table)
    alias = cuda_alias(table)
    ways: dict[str, list] = {
        "datapath": [lambda i=i: unified[i] for i in sets_cuda],
        "dp_sync": [lambda i=i: gather(unified, i, sync=True) for i in sets_cuda],
        "dp_sort": [lambda i=i: gather(unified, i, sort=True) for i in sets_cuda],
        "dp_nosort": [lambda i=i: gather(unified, i, sort=False) for i in sets_cuda],
        "naive_zc": [lambda i=i: torch.index_select(alias, 0, i) for i in sets_cuda],
    }
    if ablation:
        ways["dp_shiftmask"] = [lambda i=i: gather(unified, i, mode="shift_mask") for i in sets_cuda]
        ways["dp_unaligned"] = [lambda i=i: gather(unified, i, mode="unaligned") for i in sets_cuda]
    if include_py:
        out_pinned = pinned_empty((sets[0].numel(), table.shape[1]), table.dtype)

        def py_pinned(i: torch.Tensor) -> torch.Tensor:
            torch.index_select(table, 0, i, out=out_pinned)
            return out_pinned.to("cuda", non_blocking=True)

        ways["py"] = [lambda i=i: table[i].to("cuda") for i in sets]
        ways["py_pinned"] = [lambda i=i: py_pinned(i) for i in sets]
    return ways


def _huge_buffer(nbytes: int) -> tuple[torch.Tensor | None, dict]:
    """A pinned buffer on 2 MiB pages (None where the machine gives none) and how it was made."""
    from datapath.memory import huge_page_bytes, huge_pinned_empty, thp_mode

    t0 = time.time()
    buf = huge_pinned_empty((nbytes // 4,), torch.float32)
    info = {"thp": thp_mode(), "huge": buf is not None}
    if buf is not None:
        _fill(buf)
        info.update(huge_page_bytes=huge_page_bytes(buf), seconds=time.time() - t0)
    print(f"huge-page buffer: {info}", flush=True)
    return buf, info


def _host_us_8k_rows(buf: torch.Tensor, row_bytes: int) -> dict[str, float]:
    """Host microseconds per call of a gather of 8192 rows of ``row_bytes`` from the pinned ``buf``: datapath (the
    default launcher, and ``launcher="driver"``: from Python) vs naive."""
    width = row_bytes // 4
    n = min(4 << 20, buf.numel() // width)
    table = buf[: n * width].view(n, width)
    idx = torch.randint(0, n, (8192,), device="cuda")
    unified, alias = as_unified(table), cuda_alias(table)
    times = {"datapath": host_us_per_call(lambda: unified[idx])}
    before = gather_config.launcher
    try:
        gather_config.launcher = "driver"
        times["dp_driver"] = host_us_per_call(lambda: unified[idx])
    finally:
        gather_config.launcher = before
    times["naive_zc"] = host_us_per_call(lambda: torch.index_select(alias, 0, idx))
    return times


def run(args: argparse.Namespace) -> dict:
    require_cuda("the gather benchmark")
    torch.manual_seed(0)
    quick = args.quick
    buf_bytes = (2 << 30) if quick else (16 << 30)
    t0 = time.time()
    buf = pinned_empty((buf_bytes // 4,), torch.float32)
    _fill(buf)
    print(f"pinned table buffer: {buf_bytes / 2**30:.0f} GiB, filled in {time.time() - t0:.1f} s", flush=True)
    big = min(buf_bytes, 1 << 30)
    peak = max(_memcpy_gbps(buf, big) for _ in range(2))
    print(f"pinned H2D memcpy: {peak:.1f} GB/s ({big >> 20} MiB)", flush=True)

    launcher = native_launcher(wait=True, timeout=300)  # built before anything is timed
    print(f"native launcher: {launcher}", flush=True)
    host_us = {f"{rb}B": _host_us_8k_rows(buf, rb) for rb in (256, 1024, 4096)}
    print(f"host time per call, 8192 rows: {host_us}", flush=True)

    row_sizes = [int(x) for x in args.row_sizes.split(",")] if args.row_sizes else \
        [256, 512, 1024, 2048, 4096, 8192, 16384]
    counts = [int(x) for x in args.counts.split(",")] if args.counts else \
        [8192, 65536, 262144] if quick else [8192, 65536, 262144, 1048576]
    max_bytes = (256 << 20) if quick else (4 << 30)
    rows: list[dict] = []
    tables = {"": buf}

    def measure(row_bytes: int, m: int, include_py: bool, sweep: str, table_rows: int = 4 << 20,
                source: str = "") -> None:
        width = row_bytes // 4
        src = tables[source]
        n = min(table_rows, src.numel() // width)
        table = src[: n * width].view(n, width)
        include_py = include_py and not args.no_py
        # enough index sets, rotated between calls, that no call finds its rows in L2 (`index_set_count`)
        sets = [torch.randint(0, n, (m,)) for _ in range(index_set_count(m, row_bytes))]
        sets_cuda = [x.cuda() for x in sets]
        turn = [0]

        def next_set() -> int:
            turn[0] = (turn[0] + 1) % len(sets)
            return turn[0]

        idx_cpu, idx_cuda = sets[0], sets_cuda[0]
        nbytes = m * row_bytes
        ideal_ms = nbytes / (peak * 1e6)
        rec = {"sweep": sweep, "row_bytes": row_bytes, "rows": m, "table_rows": n,
               "bytes": nbytes, "ideal_ms": ideal_ms, "ideal_GBps": peak}
        # small calls are decided by a few microseconds: more repetitions for a steadier median
        reps = 3 if nbytes > (1 << 30) else 9 if nbytes > (64 << 20) else 25
        ways = _ways(table, sets, sets_cuda, include_py, ablation=sweep == "align")
        slow = {k: ways.pop(k) for k in ("py", "py_pinned") if k in ways}  # 10x slower: timed apart, fewer times
        warm_gpu()
        measured = _interleaved_ms(ways, next_set, reps, warm=2)
        for name, fns in slow.items():
            measured[name] = cuda_time_ms(lambda: fns[next_set()](), warmup=1, repeat=3)
        for name, ms in measured.items():
            rec[f"{name}_ms"] = ms
            rec[f"{name}_GBps"] = nbytes / ms / 1e6
        want = table[idx_cpu[:1000]].view(torch.int32)  # random bytes: compare bits (NaNs are not equal)
        got = gather(as_unified(table), idx_cuda[:1000]).cpu().view(torch.int32)
        assert torch.equal(got, want), "datapath gather wrong"
        check_errors()
        rec["table_bytes"] = n * row_bytes
        rows.append(rec)
        print(f"  {sweep:5s} row {row_bytes:6d} B x {m:8d}: datapath {rec['datapath_GBps']:.1f} GB/s "
              f"({rec['datapath_GBps'] / peak:.2f} of memcpy), sync {rec['dp_sync_GBps']:.1f}, sort "
              f"{rec['dp_sort_GBps']:.1f}, nosort {rec['dp_nosort_GBps']:.1f}, naive_zc {rec['naive_zc_GBps']:.1f}"
              + (f", py {rec['py_GBps']:.1f}, py_pinned {rec['py_pinned_GBps']:.1f}" if include_py else ""),
              flush=True)

    for rb in row_sizes:
        for m in counts:
            if m * rb > max_bytes:
                continue
            measure(rb, m, include_py=m <= 262144, sweep="size")
    align_m = 65536 if quick else 262144
    if not args.no_align:
        for rb in range(2048, 2077, 4):
            measure(rb, align_m, include_py=False, sweep="align")
    # the same gathers from ever larger tables: small rows are limited by address
    # translation (one page per random row), not by the kernel: naive_zc shows it too
    gibs = ([] if args.table_gib == "none" else [int(x) for x in args.table_gib.split(",")]) if args.table_gib \
        else [1, 2] if quick else [1, 4, 16]
    huge_info: dict = {}
    if args.huge_tables:  # the same, the table on 2 MiB pages (every way reads that same memory)
        huge, huge_info = _huge_buffer(buf_bytes)
        if huge is not None:
            tables["huge"] = huge
    for source in tables:
        for rb in (256, 512, 1024):
            for gib in gibs:
                measure(rb, align_m, include_py=False, sweep=f"table{gib}G{'_' + source if source else ''}",
                        table_rows=(gib << 30) // rb, source=source)

    # the bars (issues 2 and 16); None where this run did not measure what a bar needs
    def low(values: Any) -> float | None:
        values = list(values)
        return min(values) if values else None

    size_rows = [r for r in rows if r["sweep"] == "size" and r["rows"] >= 65536]
    big = [r for r in rows if r["sweep"] == "size" and r["rows"] >= 262144 and r["row_bytes"] >= 512]
    worst = min(rows, key=lambda r: r["datapath_GBps"] / r["naive_zc_GBps"])
    bars = {
        "min_ratio_vs_naive_zc_every_config": worst["datapath_GBps"] / worst["naive_zc_GBps"],
        "min_ratio_vs_naive_zc_at": {k: worst[k] for k in ("sweep", "row_bytes", "rows")},
        "min_ratio_vs_memcpy_row_ge_512_rows_ge_262k": low(r["datapath_GBps"] / peak for r in big),
        "min_ratio_vs_memcpy_row_ge_512": low(r["datapath_GBps"] / peak for r in size_rows if r["row_bytes"] >= 512),
        "min_ratio_vs_memcpy_row_256": low(r["datapath_GBps"] / peak for r in size_rows if r["row_bytes"] == 256),
        "min_ratio_vs_memcpy_align_sweep": low(r["datapath_GBps"] / peak for r in rows if r["sweep"] == "align"),
        "min_speedup_vs_py": low(r["py_ms"] / r["datapath_ms"] for r in size_rows if "py_ms" in r),
        "min_speedup_vs_py_pinned": low(r["py_pinned_ms"] / r["datapath_ms"] for r in size_rows if "py_pinned_ms" in r),
        "speedup_vs_naive_zc_2052B": next((r["naive_zc_ms"] / r["datapath_ms"] for r in rows
                                           if r["sweep"] == "align" and r["row_bytes"] == 2052), None),
        "min_ratio_sync_vs_default": min(r["dp_sync_GBps"] / r["datapath_GBps"] for r in rows),
    }
    settings = {k: getattr(gather_config, k) for k in ("launcher", "threads_per_block", "blocks_per_sm", "sort_indices",
                                                        "sort_min_rows_short", "sort_min_bytes_short", "sort_short_row_bytes",
                                                        "sort_min_rows", "sort_max_row_bytes", "sort_min_rows_long",
                                                        "sort_min_bytes_long",
                                                        "sort_min_table_bytes", "sort_method", "host_window_bytes",
                                                        "host_min_inflight_bytes", "sync_bounds_check")}
    return {"quick": quick, "table_buffer_bytes": buf_bytes, "gather_config": settings, "memcpy_GBps": peak,
            "huge_pages": huge_info, "host_us_per_call_8k_rows": host_us,
            "native_launcher": {"status": launcher.status, "launches": native_launcher().launches},
            "rows": rows, "bars": bars}


def plot(result: dict, name: str = "gather") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.8))
    m_plot = max((r["rows"] for r in rows if r["sweep"] == "size" and "py_ms" in r),
                 default=max((r["rows"] for r in rows if r["sweep"] == "size"), default=0))
    sel = [r for r in rows if r["sweep"] == "size" and r["rows"] == m_plot]
    xs = [r["row_bytes"] for r in sel]
    for way, style in [("datapath", "o-"), ("dp_sync", "o--"), ("dp_nosort", "o:"),
                       ("naive_zc", "x-"), ("py_pinned", "d-"), ("py", "v-")]:
        if sel and f"{way}_GBps" in sel[0]:
            a.plot(xs, [r[f"{way}_GBps"] for r in sel], style, label=way)
    a.axhline(result["memcpy_GBps"], color="k", lw=1, ls=":", label="ideal (pinned memcpy)")
    a.set_xscale("log", base=2)
    a.set_xlabel("row size (bytes)")
    a.set_ylabel("GB/s")
    a.set_title(f"gather of {m_plot} random rows")
    a.legend(fontsize=8)
    al = [r for r in rows if r["sweep"] == "align"]
    xs = [r["row_bytes"] for r in al]
    for way, style in [("datapath", "o-"), ("dp_nosort", "o:"), ("dp_shiftmask", "s--"), ("dp_unaligned", "^--"),
                       ("naive_zc", "x-")]:
        b.plot(xs, [r[f"{way}_GBps"] for r in al], style, label=way)
    b.axhline(result["memcpy_GBps"], color="k", lw=1, ls=":", label="ideal")
    b.set_xlabel("row size (bytes)")
    b.set_title(f"alignment sweep, {al[0]['rows'] if al else 0} rows")
    b.legend(fontsize=8)
    for rb, style in ((256, "o-"), (512, "s-"), (1024, "^-")):
        for huge in (False, True):
            ts = [r for r in rows if r["sweep"].startswith("table") and r["sweep"].endswith("_huge") == huge
                  and r["row_bytes"] == rb]
            if not ts:
                continue
            tag = f"{rb} B{', 2 MiB pages' if huge else ''}"
            gib = [r["table_bytes"] / 2**30 for r in ts]
            c.plot(gib, [r["datapath_GBps"] for r in ts], style, label=f"datapath {tag}", lw=2.5 if huge else 1.5)
            c.plot(gib, [r["naive_zc_GBps"] for r in ts], style.replace("-", ":"), label=f"naive_zc {tag}", alpha=0.6)
    c.axhline(result["memcpy_GBps"], color="k", lw=1, ls=":")
    c.set_xscale("log", base=2)
    c.set_xlabel("table size (GiB)")
    c.set_title("small rows vs table size (page translation)")
    c.legend(fontsize=7)
    fig.suptitle(f"B1 zero-copy gather on {device_label()}")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{name}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 GiB table, fewer sizes (about a minute)")
    ap.add_argument("--row-sizes", default="", help="comma-separated row sizes in bytes (default: 256..16384)")
    ap.add_argument("--counts", default="", help="comma-separated rows per call (default: 8192..1048576)")
    ap.add_argument("--table-gib", default="", help="comma-separated table sizes of the table sweep (default 1,4,16; none: no table sweep)")
    ap.add_argument("--no-align", action="store_true", help="skip the alignment sweep")
    ap.add_argument("--no-py", action="store_true", help="skip the two CPU-gather ways")
    ap.add_argument("--huge-tables", action="store_true",
                    help="the table sweep also from a buffer on 2 MiB pages (datapath.memory.huge_pinned_empty)")
    ap.add_argument("--name", default="gather", help="result name (results/<name>.json, .png)")
    args = ap.parse_args()
    result = run(args)
    path = write_result(args.name, result)
    plot(result, args.name)
    table = [{"sweep": r["sweep"], "row_B": r["row_bytes"], "rows": r["rows"],
              "datapath": r["datapath_GBps"], "sync": r["dp_sync_GBps"], "sort": r["dp_sort_GBps"],
              "nosort": r["dp_nosort_GBps"], "naive_zc": r["naive_zc_GBps"],
              "dp/naive": r["datapath_GBps"] / r["naive_zc_GBps"],
              "py_pinned": r.get("py_pinned_GBps", ""), "py": r.get("py_GBps", ""),
              "dp/ideal": r["datapath_GBps"] / result["memcpy_GBps"]} for r in result["rows"]]
    print(f"\nGB/s; ideal = pinned memcpy {result['memcpy_GBps']:.1f} GB/s; results in {path}")
    print_table(table)
    print("bars:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result["bars"].items()})


if __name__ == "__main__":
    main()
