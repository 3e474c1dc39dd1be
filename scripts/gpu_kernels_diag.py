"""Where a host-bound layer forward+backward spends its time on the GPU machine (citeseer shape, 128 -> 64).

Decomposes the step: the autograd engine alone, a Linear, one aggregation, the layers (datapath, PyG), each with
the engine's device threads on and off (``torch.autograd.set_multithreading_enabled``) and with the cyclic GC off;
a torch.profiler table (CPU self time, CUDA time) of datapath's GINConv step; then the aggregation alone against
cuSPARSE on ppi and citeseer (host us and GPU ms per call, forward and forward+backward).  Host us per step:
`benchmarks._common.wall_us_per_call` (back-to-back steps, one sync at each end).
``--prof``: only the cProfile of citeseer's forward+backward steps (F=16).
``--fb``: only the forward+backward step's kernels, datapath vs cuSPARSE, on the graphs where B3's fwd+bwd is slow.
Run on the GPU machine:  PYTHONPATH=src:. python scripts/gpu_kernels_diag.py [--full | --fb]
"""
from __future__ import annotations

import gc
import sys
import threading
import time

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg
from torch.profiler import ProfilerActivity, profile

from benchmarks._common import wall_us_per_call
from datapath.nn import GCNConv, GINConv, SAGEConv
from datapath.ops import aggregate
from datapath.testing import edge_index, seed_graph


def step(fn, x: torch.Tensor, gy: torch.Tensor):
    def call() -> None:
        x.grad = None
        fn(x).backward(gy)
    return call


def _profiled(fn, steps: int, warm: int):
    """The profile of ``steps`` calls of ``fn`` (CPU and CUDA activity) after ``warm`` unprofiled ones."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def table(label: str, fn, rows: int = 22) -> None:
    prof = _profiled(fn, 20, 5)
    print(f"\n== profile {label} (20 steps)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kern) / 20
    print(f"   kernels/step {len(kern) / 20:.1f}, GPU busy us/step {gpu_us:.1f}")
    threads = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None:
            threads[e.thread] = threads.get(e.thread, 0) + e.cpu_time_total
    print("   top-level CPU us/step by thread: " + ", ".join(f"{t}:{v / 20:.0f}" for t, v in threads.items()))


def fb_kernels(names: tuple[str, ...], cases: tuple[tuple[int, torch.dtype], ...]) -> None:
    """Where a forward+backward step of the aggregation goes beyond its two kernels: per graph and width, the
    step's ms (interleaved batches, as B3 times it) of datapath and of cuSPARSE with a prebuilt transpose, the
    forward alone, and each way's GPU kernels in one profiled step (name, us) with the step's wall time."""
    from benchmarks._common import interleaved_ms  # noqa: PLC0415
    from benchmarks.aggregate import _PretransposedSpMM, csr_tensors  # noqa: PLC0415
    from datapath.ops import plan_aggregation  # noqa: PLC0415

    for name in names:
        g, _ = seed_graph(name, device="cuda")
        for f, dt in cases:
            a, at = csr_tensors(g, dt)
            x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt).requires_grad_()
            gy = torch.randn(g.num_dst_nodes, f, device="cuda").to(dt)
            plan_aggregation(g, f, dt, probe=True)
            ways = {"dp": lambda x, g=g: aggregate(g, x),
                    "cs": lambda x, a=a, at=at: _PretransposedSpMM.apply(x, a, at)}
            fbs = {w: step(fn, x, gy) for w, fn in ways.items()}
            fws = {w: (lambda fn=fn: fn(x.detach())) for w, fn in ways.items()}
            t_fb = interleaved_ms(fbs, 5)
            t_f = interleaved_ms(fws, 5)
            with torch.autograd.set_multithreading_enabled(False):
                t_fb1 = interleaved_ms(fbs, 5)
            print(f"\n== {name} F={f} {str(dt)[6:]}: fb ms dp {t_fb['dp']:.4f} cs {t_fb['cs']:.4f} | 1 thread dp "
                  f"{t_fb1['dp']:.4f} cs {t_fb1['cs']:.4f} | fwd dp {t_f['dp']:.4f} cs {t_f['cs']:.4f} | wall us/step "
                  f"dp {wall_us_per_call(fbs['dp']):.1f} cs {wall_us_per_call(fbs['cs']):.1f}", flush=True)
            for w, fn in fbs.items():
                prof = _profiled(fn, 5, 3)
                kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                per: dict[str, list[float]] = {}
                for e in kern:
                    per.setdefault(e.name[:60], []).append(e.device_time)
                print(f"   {w}: " + "; ".join(f"{k} x{len(v) / 5:g} {sum(v) / len(v):.1f}us" for k, v in per.items()))
            del x, gy


def main() -> None:
    if "--prof" in sys.argv:  # only the host's Python per forward+backward step
        python_profile("citeseer", 16)
        return
    if "--fb" in sys.argv:
        fb_kernels(("artist", "ppi", "soc-BlogCatalog", "citeseer"),
                   ((16, torch.float32), (16, torch.float16), (128, torch.bfloat16), (64, torch.float32)))
        return
    full = "--full" in sys.argv  # also the 1-thread / no-GC columns and the profiler table
    print(f"python {sys.version.split()[0]} torch {torch.__version__} switchinterval {sys.getswitchinterval()}; "
          f"threads {[t.name for t in threading.enumerate()]}", flush=True)
    g, _ = seed_graph("citeseer", device="cuda")
    ei = edge_index(g)
    n = g.num_src_nodes
    x = torch.randn(n, 128, device="cuda", requires_grad=True)
    gy = torch.randn(n, 64, device="cuda")
    h64 = torch.randn(n, 64, device="cuda", requires_grad=True)
    lin = torch.nn.Linear(128, 64).cuda()
    w = torch.nn.Parameter(torch.randn(64, 128, device="cuda"))
    ways = {
        "mul(x)": (lambda x: x * 2, x, torch.randn(n, 128, device="cuda")),
        "linear nobias": (lambda x: F.linear(x, w), x, gy),
        "Linear": (lambda x: lin(x), x, gy),
        "aggregate F64": (lambda h: aggregate(g, h), h64, gy),
        "aggregate F64 gcn": (lambda h: aggregate(g, h, norm="gcn"), h64, gy),
    }
    layers = {}
    for kind, ours, theirs in (
        ("SAGE", SAGEConv(128, 64), pyg.SAGEConv(128, 64)),
        ("GCN", GCNConv(128, 64), pyg.GCNConv(128, 64, add_self_loops=False, cached=True)),
        ("GIN", GINConv(torch.nn.Linear(128, 64)), pyg.GINConv(torch.nn.Linear(128, 64))),
    ):
        theirs, ours = theirs.cuda(), ours.cuda()
        ours.load_state_dict(theirs.state_dict(), strict=False)
        layers[kind] = (ours, theirs)
        ways[f"{kind} ours"] = (lambda x, m=ours: m(g, x), x, gy)
        ways[f"{kind} pyg"] = (lambda x, m=theirs: m(x, ei), x, gy)
    print(f"{'way':>20} {'fwd_us':>8} {'fb_us':>8} {'fb_1thr':>8} {'fb_nogc':>8}  (host us per step)")
    for name, (fn, inp, grad) in ways.items():
        def f_only(fn=fn, inp=inp) -> None:
            with torch.no_grad():
                fn(inp)
        fb = step(fn, inp, grad)
        t_f = wall_us_per_call(f_only)
        t_fb = min(wall_us_per_call(fb) for _ in range(3))
        t_1 = t_ng = float("nan")
        if full:
            with torch.autograd.set_multithreading_enabled(False):
                t_1 = wall_us_per_call(fb)
            gc.disable()
            t_ng = wall_us_per_call(fb)
            gc.enable()
        print(f"{name:>20} {t_f:8.1f} {t_fb:8.1f} {t_1:8.1f} {t_ng:8.1f}", flush=True)
    if full:
        ours, theirs = layers["GIN"]
        table("GIN ours", step(lambda x: ours(g, x), x, gy), rows=16)
    spmm_host(("ppi", "citeseer", "soc-BlogCatalog", "artist") if full else ("ppi",), (16, 64, 128) if full else (16, 64))
    if full:
        python_profile("ppi", 128)


def python_profile(name: str, f: int) -> None:
    """cProfile of 200 aggregate forward+backward steps (the host's Python, by function)."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    g, _ = seed_graph(name, device="cuda")
    x = torch.randn(g.num_src_nodes, f, device="cuda").requires_grad_()
    gy = torch.randn(g.num_dst_nodes, f, device="cuda")
    fb = step(lambda x: aggregate(g, x), x, gy)
    for _ in range(10):
        fb()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread, where cProfile sees it
        prof.enable()
        for _ in range(200):
            fb()
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print(f"\n== cProfile {name} F={f} float32, 200 forward+backward steps\n" + s.getvalue()[:14000], flush=True)


def host_us(fn, calls: int = 40) -> float:
    """Host microseconds per call to enqueue ``fn`` (no synchronisation at the end: few enough calls that the launch
    queue never fills), the median of 5 batches."""
    out = []
    for _ in range(5):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(out)[2]


def spmm_host(names: tuple[str, ...], widths: tuple[int, ...]) -> None:
    """Host us per call (enqueue only) and GPU ms per call (CUDA events, back-to-back batch) of the forward (no
    autograd) and of a forward+backward step, datapath vs cuSPARSE (torch.sparse.mm; the backward with a prebuilt
    transpose), where the GPU work is a few tens of microseconds (ppi) and on citeseer."""
    from benchmarks._common import interleaved_ms  # noqa: PLC0415
    from benchmarks.aggregate import _PretransposedSpMM, csr_tensors  # noqa: PLC0415
    from datapath.ops import plan_aggregation  # noqa: PLC0415

    print(f"\n{'graph':>9} {'F':>4} {'dtype':>9} {'plan':>9} {'dp_f_us':>8} {'cs_f_us':>8} {'dp_f_ms':>8} "
          f"{'cs_f_ms':>8} {'dp_fb_us':>8} {'cs_fb_us':>8}")
    for name in names:
        g, _ = seed_graph(name, device="cuda")
        for dt in (torch.float32, torch.float16):
            a, at = csr_tensors(g, dt)
            for f in widths:
                x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt).requires_grad_()
                gy = torch.randn(g.num_dst_nodes, f, device="cuda").to(dt)
                plan = plan_aggregation(g, f, dt, probe=True)

                def f_dp(x=x, g=g) -> None:
                    with torch.no_grad():
                        aggregate(g, x)

                def f_cs(x=x, a=a) -> None:
                    with torch.no_grad():
                        torch.sparse.mm(a, x)
                fb_dp = step(lambda x, g=g: aggregate(g, x), x, gy)
                fb_cs = step(lambda x, a=a, at=at: _PretransposedSpMM.apply(x, a, at), x, gy)
                ev = interleaved_ms({"dp": f_dp, "cs": f_cs}, 5)
                print(f"{name:>9} {f:>4} {str(dt)[6:]:>9} {plan.kernel:>9} {host_us(f_dp):8.1f} "
                      f"{host_us(f_cs):8.1f} {ev['dp']:8.4f} {ev['cs']:8.4f} {host_us(fb_dp):8.1f} "
                      f"{host_us(fb_cs):8.1f}", flush=True)


if __name__ == "__main__":
    main()
