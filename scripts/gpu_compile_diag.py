"""Why a regionally compiled HF model is slower than the whole model compiled (GPU machine, B4's shapes).

For each way: step time (median of 5 after warm-up; the host's time to enqueue the step beside it: equal
means the step is host-bound), peak, and a torch.profiler table of one step (CUDA kernels by total time),
so the two ways' kernels can be compared line by line.  Ways: ``recipe`` (PyTorch's regional compilation, each block's module compiled), ``regional``
(datapath's `compile_blocks`: blocks, output head, loss),
``whole`` (`torch.compile(model)`), ``datapath`` (`offload(model, memory_budget=B, compile=True)`, B given
in GB by ``--budget-gb`` (several: comma-separated), default 80% of keep's measured peak; ``--variants``
runs it with the forward's admission waits removed, to see what they cost).
Run on the GPU machine:  PYTHONPATH=src:. python scripts/gpu_compile_diag.py [--model gpt2] [--ways a,b]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._offload_workloads import build
from benchmarks.offload import method_context
from datapath.offload import offload


def measure(name: str, fn, steps: int, warmup: int, model: torch.nn.Module, rows: int,
            cprofile: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        fn().backward()
        opt.step()

    for _ in range(warmup):
        step()
    # one step in phases: host time to enqueue the forward and the backward, GPU time of each (events)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    ev[0].record()
    loss = fn()
    ev[1].record()
    t1 = time.perf_counter()
    loss.backward()
    ev[2].record()
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name}: host enqueue forward {(t1 - t0) * 1e3:.1f} ms, backward {(t2 - t1) * 1e3:.1f} ms; GPU forward "
          f"{ev[0].elapsed_time(ev[1]):.1f} ms, backward {ev[1].elapsed_time(ev[2]):.1f} ms", flush=True)
    if cprofile:
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    walls, enq = [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        enq.append((t1 - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 1e9
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"\n=== {name}: step {statistics.median(walls):.1f} ms (enqueue {statistics.median(enq):.1f} ms), "
          f"peak {peak:.2f} GB, kernel time in one step {gpu_ms:.1f} ms", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70),
          flush=True)
    opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _admission(variant: str):
    """The budget policy's forward admission as shipped, or without its waits (a diagnostic: the budget may break)."""
    from datapath.offload.budget import BudgetPolicy  # noqa: PLC0415 - private: the diagnostic swaps its methods

    saved = (BudgetPolicy.admit, BudgetPolicy.admit_kept)
    if variant == "nohold-kept":
        BudgetPolicy.admit_kept = lambda self, rec, nbytes: 0.0
    elif variant == "nohold":
        BudgetPolicy.admit_kept = lambda self, rec, nbytes: 0.0
        BudgetPolicy.admit = lambda self, rec, nbytes: self.c.transfers.admit(nbytes, 2e9)
    elif variant != "hold":
        raise SystemExit(f"unknown variant {variant!r}")
    try:
        yield
    finally:
        BudgetPolicy.admit, BudgetPolicy.admit_kept = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--ways", default="regional,whole,datapath")
    ap.add_argument("--budget-gb", default=None, help="one or more budgets, comma-separated (the datapath way)")
    ap.add_argument("--variants", default="hold",
                    help="the datapath way's admission, comma-separated: hold (as shipped), nohold-kept (kept "
                         "storages never wait for stores), nohold (no storage waits for memory; stores still "
                         "bounded by bytes in flight)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--cprofile", action="store_true", help="the datapath way: cProfile of 3 steps (host time)")
    args = ap.parse_args()
    w = build(args.model, torch.device("cuda"), smoke=False)
    model = w.model
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    measure("eager keep", lambda: w.loss(model, w.batch), args.steps, 2, model, 12)
    keep_peak = torch.cuda.max_memory_allocated()
    for way in args.ways.split(","):
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        if way in ("recipe", "regional"):  # set up as B4 sets up its peer and its compiled reference
            with method_context(w, "compile_regional" if way == "recipe" else "compile_datapath", None, None):
                measure(way, lambda: w.loss(model, w.batch), args.steps, 3, model, args.rows)
        elif way == "whole":
            whole = torch.compile(model)
            measure(way, lambda: w.loss(whole, w.batch), args.steps, 3, model, args.rows)
            del whole
        elif way == "datapath":
            budgets = [int(float(b) * 1e9) for b in args.budget_gb.split(",")] if args.budget_gb else \
                [int(keep_peak * 0.8)]
            for budget in budgets:
                for variant in args.variants.split(","):
                    torch._dynamo.reset()
                    gc.collect()
                    torch.cuda.empty_cache()
                    with _admission(variant), offload(model, memory_budget=budget, compile=True) as cache:
                        measure(f"{way} budget {budget / 1e9:.2f} GB {variant}", lambda: w.loss(model, w.batch),
                                args.steps, 8, model, args.rows, cprofile=args.cprofile)
                        plan = cache.plan.as_dict() if cache.plan is not None else None
                        st = cache.stats
                        print(f"plan {plan}\npacks {st.packs} offloaded {st.bytes_offloaded / 1e9:.2f} GB "
                              f"store wait {st.store_wait_seconds:.3f} s", flush=True)
        print(f"({way}: {time.perf_counter() - t0:.0f} s with compilation)", flush=True)
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
