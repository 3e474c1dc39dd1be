"""Where an aggregation's time goes: host overhead per call (cProfile) and GPU time per kernel (CUDA graphs).

    PYTHONPATH=src:. python scripts/profile_aggregate.py [--out DIR]

1. Host: the citeseer-shaped graph at F=16 (launch-bound): microseconds per call of `as_csr`,
   `aggregate` (no autograd; forward+backward), `torch.sparse.mm`; cProfile's top functions.
2. GPU: every kernel forced by a plan, 10 calls captured in a CUDA graph and replayed, so the time
   is the kernels' alone (no launch gaps); cuSPARSE the same way; achieved GB/s against the bytes
   a gather must move (each edge's source row, each output row once, the indices).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

import torch

from benchmarks._common import wall_us_per_call
from datapath.ops import aggregate, as_csr, plan_aggregation
from datapath.testing.graphs import seed_graph


def per_call_us(fn) -> float:
    return wall_us_per_call(fn, calls=300, warmup=20)


def host_overhead(out: dict) -> str:
    g, _ = seed_graph("citeseer", device="cuda")
    x = torch.randn(g.num_src_nodes, 16, device="cuda")
    xg = x.clone().requires_grad_()
    gy = torch.randn(g.num_dst_nodes, 16, device="cuda")
    a = torch.sparse_csr_tensor(g.indptr.int(), g.indices.int(), torch.ones(g.indices.numel(), device="cuda"),
                                (g.num_dst_nodes, g.num_src_nodes))
    r = {}
    r["as_csr_us"] = per_call_us(lambda: as_csr(g))
    with torch.no_grad():
        r["aggregate_us"] = per_call_us(lambda: aggregate(g, x))
        r["aggregate_mean_us"] = per_call_us(lambda: aggregate(g, x, "mean"))
        r["sparse_mm_us"] = per_call_us(lambda: torch.sparse.mm(a, x))
        r["empty_us"] = per_call_us(lambda: x.new_empty((g.num_dst_nodes, 16)))
    r["aggregate_fb_us"] = per_call_us(lambda: aggregate(g, xg).backward(gy))
    out["host"] = r
    print("host:", {k: round(v, 1) for k, v in r.items()}, flush=True)
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(500):
            aggregate(g, x)
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        aggregate(g, xg).backward(gy)
    prof.disable()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


def graph_ms(fn, calls: int = 10, replays: int = 5) -> float:
    """GPU ms per call of ``fn`` (CUDA-graph replay of ``calls`` calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        for _ in range(calls):
            fn()
    cg.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        cg.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / (calls * replays)


def kernels(out: dict) -> None:
    rows = []
    configs = [("soc-BlogCatalog", (16, 64, 128, 602), (torch.float32, torch.bfloat16)),
               ("amazon0505", (16, 64, 602), (torch.float32,)), ("ppi", (64,), (torch.float32,))]
    plans = [("rows", {}), ("rows_u8", {"unroll": 8}), ("rows_cut512", {"cut": 512}), ("groups", {"kernel": "groups"}),
             ("tensor_core", {"kernel": "tensor_core"}), ("cusparse", {"kernel": "cusparse"})]
    for name, widths, dtypes in configs:
        g, _ = seed_graph(name, device="cuda")
        e, n = g.indices.numel(), g.num_dst_nodes
        for dt in dtypes:
            a = torch.sparse_csr_tensor(g.indptr.int(), g.indices.int(), torch.ones(e, device="cuda", dtype=dt),
                                        (n, g.num_src_nodes))
            for f in widths:
                x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt)
                gb = (e * f * x.element_size() + n * f * x.element_size() + e * 4) / 1e9
                rec = {"graph": name, "F": f, "dtype": str(dt), "GB": gb}
                with torch.no_grad():
                    for label, kw in plans:
                        if label == "tensor_core" and dt == torch.float32:
                            continue
                        kw = dict(kw)
                        p = plan_aggregation(g, f, dt, **({"kernel": "rows"} | kw))
                        try:
                            rec[label] = graph_ms(lambda p=p: aggregate(g, x, plan=p))
                        except Exception as exc:  # noqa: BLE001
                            rec[label] = None
                            print(f"  {label}: {type(exc).__name__} {str(exc)[:120]}")
                    try:
                        rec["torch_sparse_mm"] = graph_ms(lambda: torch.sparse.mm(a, x))
                    except Exception as exc:  # noqa: BLE001
                        rec["torch_sparse_mm"] = None
                        print(f"  torch.sparse.mm capture: {type(exc).__name__} {str(exc)[:120]}")
                rows.append(rec)
                best = min((v for k, v in rec.items() if k not in ("graph", "F", "dtype", "GB") and v), default=0)
                print(f"  {name} F={f} {dt}: " + " ".join(f"{k}={v:.3f}" for k, v in rec.items()
                                                          if isinstance(v, float) and k != "GB")
                      + f"  best {gb / best:.0f} GB/s" if best else "", flush=True)
    out["kernels"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name()}
    text = host_overhead(out)
    Path(args.out, "profile_host.txt").write_text(text)
    print(text[:6000])
    kernels(out)
    Path(args.out, "profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
