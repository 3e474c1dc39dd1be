"""Where a datapath-all step's time goes on the B4 shapes (GPU only): forward and backward time per method,
the offloader's counters per step, and a torch.profiler table of one datapath-all step.

Run on the GPU machine: PYTHONPATH=src:. python scripts/gpu_offload_diag.py [--models gpt2,llama] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.offload import build  # noqa: E402
from datapath.offload import offload  # noqa: E402


def steps(w, ctx_fn, n: int = 4):
    model = w.model
    out = []
    for _ in range(n):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with ctx_fn():
            loss = w.loss(model, w.batch)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, torch.cuda.max_memory_allocated() / 1e9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--out", default=".")
    ap.add_argument("--units", default="leaves")
    args = ap.parse_args()
    res = {}
    for name in args.models.split(","):
        w = build(name, torch.device("cuda"), False)
        r = {}
        r["keep"] = steps(w, contextlib.nullcontext)
        r["save_on_cpu"] = steps(w, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        with offload(w.model, units=args.units) as cache:
            r["datapath-all"] = steps(w, contextlib.nullcontext, 3)
            st0 = cache.reset_stats()
            r["datapath-all-2"] = steps(w, contextlib.nullcontext, 2)
            st = cache.stats
            r["stats_per_step"] = {k: (v / 2 if isinstance(v, (int, float)) else None) for k, v in vars(st).items()
                                   if isinstance(v, (int, float))}
            r["bandwidth"] = (st.write_bandwidth / 1e9, st.read_bandwidth / 1e9, cache.bandwidth())
            del st0
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                steps(w, contextlib.nullcontext, 1)
            tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            tab2 = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
            Path(args.out, f"prof_{name}.txt").write_text(tab + "\n\n" + tab2)
            prof.export_chrome_trace(str(Path(args.out, f"trace_{name}.json")))
        res[name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "stats_per_step"}, default=str), flush=True)
        print(name, "per step:", {k: round(v, 4) for k, v in r["stats_per_step"].items() if v}, flush=True)
        del w
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out, "diag.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
