"""Timeline of B2 training batches: what each CUDA stream and each CPU thread is busy with.

Trains the datapath (and gpu_resident) way of B2 on a preset with the prefetching loader,
records a few batches (a new epoch: the first includes filling the pipeline) with ``torch.profiler`` and prints, per CUDA stream and
per CPU thread, the busy time per batch (union of kernel / op intervals) and the longest
kernels; the Chrome traces go to ``$OUT`` (or ``--out``) for a closer look.  Modes:

- ``datapath``: the loader's default (features gathered on their own stream, not waited for);
- ``datapath-serial``: the gather on the sampling stream, the producer waiting for each batch;
- ``gpu_resident``: graph and features in GPU memory.

Run on the GPU machine: PYTHONPATH=src:. python benchmarks/gnn_trace.py [--dataset products] [--batches 8]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from datapath.apps.machine import use_blocking_sync

BLOCKING = use_blocking_sync() if torch.cuda.is_available() else False

from benchmarks.gnn_epoch import dataset_spec, place  # noqa: E402
from datapath.apps import train_epoch  # noqa: E402
from datapath.graph import generate  # noqa: E402
from datapath.loaders import NeighborLoader  # noqa: E402
from datapath.sampling import NeighborSampler  # noqa: E402
from datapath.nn.models import build_model  # noqa: E402


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace_path: Path, batches: int) -> dict:
    events = json.load(open(trace_path))["traceEvents"]
    kern = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    cpu = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    t0 = min(e["ts"] for e in kern)
    t1 = max(e["ts"] + e["dur"] for e in kern)
    per_stream: dict = defaultdict(list)
    names: dict = defaultdict(lambda: defaultdict(float))
    for e in kern:
        s = e.get("args", {}).get("stream", e.get("tid"))
        per_stream[s].append((e["ts"], e["ts"] + e["dur"]))
        names[s][e["name"][:70]] += e["dur"]
    threads: dict = defaultdict(list)
    for e in cpu:
        threads[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    out = {"wall_ms_per_batch": (t1 - t0) / 1e3 / batches, "streams": {}, "threads": {}}
    for s, iv in per_stream.items():
        top = sorted(names[s].items(), key=lambda kv: -kv[1])[:6]
        out["streams"][str(s)] = {"busy_ms_per_batch": _union(iv) / 1e3 / batches,
                                  "kernels_per_batch": len(iv) / batches,
                                  "top_ms_per_batch": {k: v / 1e3 / batches for k, v in top}}
    for t, iv in threads.items():
        out["threads"][str(t)] = {"busy_ms_per_batch": _union(iv) / 1e3 / batches, "ops_per_batch": len(iv) / batches}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="products")
    ap.add_argument("--model", default="sage")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1024, help="seeds a batch [1024, B2's]")
    ap.add_argument("--modes", default="datapath,datapath-serial,gpu_resident")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = generate(dataset_spec(args.dataset, argparse.Namespace(quick=False, seed=0, papers_feature_gb=40.0)),
                  progress=False)
    dev = torch.device("cuda")
    report = {"dataset": args.dataset, "model": args.model, "batch_size": args.batch_size, "blocking_sync": BLOCKING,
              "gpu": torch.cuda.get_device_name(), "modes": {}}
    for mode in args.modes.split(","):
        placed = place(ds, "gpu_resident" if mode == "gpu_resident" else "datapath", {}, args)
        placed.pop("seconds")
        torch.manual_seed(0)
        model = build_model(args.model, ds.num_features, 256, ds.num_classes, 3, dropout=0.5).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
        loader = NeighborLoader(placed["graph"], ds.train_idx, NeighborSampler([15, 10, 5], seed=0),
                                args.batch_size,
                                shuffle=True, features=placed["features"], labels=placed["labels"], device=dev,
                                prefetch=1, prepare=model.prepare_batch)
        loader.gather_stream = "serial" if mode == "datapath-serial" else "sample"
        train_epoch(model, loader, opt, max_batches=8)
        t = time.perf_counter()
        plain = train_epoch(model, loader, opt, max_batches=30)
        plain_ms = (time.perf_counter() - t) / 30 * 1e3
        trace = out_dir / f"trace_{args.dataset}_{args.model}_{mode}_b{args.batch_size}.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            train_epoch(model, loader, opt, max_batches=args.batches)
        prof.export_chrome_trace(str(trace))
        summ = summarize(trace, args.batches)
        summ["untraced_ms_per_batch"] = plain_ms
        summ["untraced_cpu_ms_per_batch"] = plain.cpu_s / plain.batches * 1e3
        report["modes"][mode] = summ
        with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
            g.write(f.read())
        trace.unlink()
        print(f"== {mode}: untraced {plain_ms:.1f} ms/batch (cpu {summ['untraced_cpu_ms_per_batch']:.1f}); "
              f"traced {summ['wall_ms_per_batch']:.1f} ms/batch")
        for s, v in sorted(summ["streams"].items(), key=lambda kv: -kv[1]["busy_ms_per_batch"]):
            top = "; ".join(f"{k} {ms:.2f}" for k, ms in list(v["top_ms_per_batch"].items())[:4])
            print(f"   stream {s:>4}: busy {v['busy_ms_per_batch']:6.2f} ms, {v['kernels_per_batch']:5.0f} kernels | {top}")
        for t, v in sorted(summ["threads"].items(), key=lambda kv: -kv[1]["busy_ms_per_batch"])[:4]:
            print(f"   thread {t:>8}: busy {v['busy_ms_per_batch']:6.2f} ms, {v['ops_per_batch']:5.0f} ops")
        del loader, model, opt, placed
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    summary = out_dir / f"trace_{args.dataset}_{args.model}_b{args.batch_size}.json"
    summary.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
