"""Where does the CPU time of a B2 training batch go?  cProfile of the loader's producer thread and the training thread.

Trains GraphSAGE on a B2 preset with the prefetching loader (the B2 configuration) and runs
cProfile in the producer thread (sampling, gather launch, ``prepare``) or in the training
thread, then prints that thread's functions by own time and by cumulative time, with
the per-batch wall and thread CPU times (one thread per run: Python 3.12 allows one cProfile at a time).  A diagnostic for the GPU machine.

Run: PYTHONPATH=src:. python scripts/profile_gnn_cpu.py [--way datapath|gpu_resident] [--batches 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from datapath.apps import use_blocking_sync

use_blocking_sync()

from benchmarks.gnn_epoch import dataset_spec, place  # noqa: E402
from datapath.apps import train_epoch  # noqa: E402
from datapath.graph import generate  # noqa: E402
from datapath.loaders import NeighborLoader  # noqa: E402
from datapath.sampling import NeighborSampler  # noqa: E402
from datapath.loaders._prefetch import _Producer  # noqa: E402  (profiles the producer thread)
from datapath.nn.models import build_model  # noqa: E402


def _print(prof: cProfile.Profile, title: str, top: int, batches: int) -> None:
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        print(f"---- {title}: by {key} (seconds over {batches} batches)")
        st.sort_stats(key).print_stats(top)
        print("\n".join(s.getvalue().splitlines()[6:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--dataset", default="products")
    ap.add_argument("--way", default="datapath", help="datapath or gpu_resident")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--thread", default="producer", choices=["producer", "training"],
                    help="which thread to profile (Python 3.12 runs one cProfile at a time)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    ns = argparse.Namespace(quick=False, seed=0, papers_feature_gb=40.0)
    ds = generate(dataset_spec(args.dataset, ns), progress=False)
    placed = place(ds, args.way)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model("sage", ds.num_features, 256, ds.num_classes, 3, dropout=0.5).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
    loader = NeighborLoader(placed["graph"], ds.train_idx, NeighborSampler([15, 10, 5], seed=0), 1024,
                            shuffle=True, features=placed["features"], labels=placed["labels"], device=dev,
                            prefetch=1, prepare=model.prepare_batch)
    train_epoch(model, loader, opt, max_batches=8)
    producer = cProfile.Profile()
    inner = _Producer._run_pipelined

    def profiled(self, q, work, streams):  # type: ignore[no-untyped-def]
        producer.enable()
        try:
            return inner(self, q, work, streams)
        finally:
            producer.disable()

    consumer = cProfile.Profile()
    if args.thread == "producer":
        _Producer._run_pipelined = profiled
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if args.thread == "training":
        consumer.enable()
    st = train_epoch(model, loader, opt, max_batches=args.batches)
    if args.thread == "training":
        consumer.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.batches * 1e3
    _Producer._run_pipelined = inner
    n = st.batches
    print(f"{args.way}: wall {wall:.2f} ms/batch (profiled); producer cpu {st.producer_cpu_s / n * 1e3:.2f}, "
          f"gpu wait {st.producer_gpu_wait_s / n * 1e3:.2f}, wall {(st.sample_s + st.gather_s) / n * 1e3:.2f}; "
          f"consumer cpu {st.consumer_cpu_s / n * 1e3:.2f}, wait {st.wait_s / n * 1e3:.2f} ms/batch", flush=True)
    _print(producer if args.thread == "producer" else consumer, f"{args.thread} thread", args.top, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
