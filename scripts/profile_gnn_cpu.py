"""Where does the CPU time of a B2 training batch go?  cProfile of the datapath way (products, GraphSAGE).

Runs the loader without prefetching (everything on the main thread, so cProfile sees
sampling, gather and training), prints the functions by own time and the CPU and wall
time per batch with and without the prefetch thread.  A diagnostic for the GPU machine.

Run: PYTHONPATH=src:. python scripts/profile_gnn_cpu.py [--batches 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks.gnn_epoch import dataset_spec, place
from datapath.loaders import NeighborLoader, NeighborSampler, generate, train_epoch
from datapath.nn.models import build_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--dataset", default="products")
    ap.add_argument("--way", default="datapath", help="datapath or gpu_resident")
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    ns = argparse.Namespace(quick=False, seed=0, papers_feature_gb=40.0)
    ds = generate(dataset_spec(args.dataset, ns), progress=False)
    placed = place(ds, args.way)
    dev = torch.device("cuda")
    for prefetch in (0, 1):
        torch.manual_seed(0)
        model = build_model("sage", ds.num_features, 256, ds.num_classes, 3, dropout=0.5).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
        loader = NeighborLoader(placed["graph"], ds.train_idx, NeighborSampler([15, 10, 5], seed=0), 1024,
                                shuffle=True, features=placed["features"], labels=placed["labels"], device=dev,
                                prefetch=prefetch, prepare=model.prepare_batch)
        train_epoch(model, loader, opt, max_batches=5)
        torch.cuda.synchronize()
        prof = cProfile.Profile() if prefetch == 0 else None
        c0, t0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        st = train_epoch(model, loader, opt, max_batches=args.batches)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        c1, t1 = time.process_time(), time.perf_counter()
        print(f"prefetch={prefetch}: wall {(t1 - t0) / args.batches * 1e3:.2f} ms/batch, "
              f"cpu {(c1 - c0) / args.batches * 1e3:.2f} ms/batch (profiled: {prof is not None}); "
              f"stages {st}"[:600], flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
            print(s.getvalue()[-9000:])
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
            print(s.getvalue()[-9000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
