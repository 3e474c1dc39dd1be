"""Debug aid (GPU): where a memory-budget step's host time goes, on B4's HF GPT-2 (or another B4 model).

Runs datapath's compiled regions without offloading (the reference), then ``offload(model,
memory_budget=B, compile=True)``, timing every step (and the host time until ``backward`` returned,
before the synchronisation) and profiling a few planned steps with cProfile.  Variants after the
timed steps: garbage collection off; the saved-tensor hooks left out (only the module hooks).
``--sequence``: B4's order instead (keep, the reference, then two budget runs one after the other,
the caching allocator emptied between methods), each step's time with the allocator's device
mallocs / frees / retries in it (does the history of the profiling steps leave a pool that the
planned steps keep re-forming?).

    python scripts/gpu_offload_step_probe.py --model gpt2 --budget 12.96e9 --steps 20
    python scripts/gpu_offload_step_probe.py --model gpt2 --sequence 12.96e9,10.75e9
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._offload_workloads import build  # noqa: E402
from datapath.offload import compile_blocks, offload, uncompile_blocks  # noqa: E402


def steps(w, n: int, ctx=None, label: str = "", prof: cProfile.Profile | None = None) -> list[float]:
    model = w.model
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out, issue, allocs = [], [], []
    for _ in range(n):
        m0 = torch.cuda.memory_stats()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        opt.zero_grad(set_to_none=True)
        with ctx() if ctx else contextlib.nullcontext():
            loss = w.loss(model, w.batch)
            loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if prof is not None:
            prof.disable()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.append((t2 - t0) * 1e3)
        issue.append((t1 - t0) * 1e3)
        m1 = torch.cuda.memory_stats()
        allocs.append("/".join(str(m1.get(k, 0) - m0.get(k, 0)) for k in
                               ("num_device_alloc", "num_device_free", "num_alloc_retries")))
    print(f"{label:44s} step ms {[round(x, 1) for x in out]}\n{'':44s} host ms {[round(x, 1) for x in issue]}"
          f"\n{'':44s} mallocs/frees/retries {allocs}"
          f"\n{'':44s} median {statistics.median(out):.1f} ms (host {statistics.median(issue):.1f}), peak "
          f"{torch.cuda.max_memory_allocated() / 1e9:.2f} GB", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--budget", type=float, default=12.96e9)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--sequence", default="", help="comma-separated budgets run one after another, as B4 does")
    args = ap.parse_args()
    w = build(args.model, torch.device("cuda"), False)
    if args.sequence:
        return sequence(w, [float(b) for b in args.sequence.split(",")], args.steps)
    torch.cuda.synchronize()
    compile_blocks(w.model)
    steps(w, 3, label="reference warm-up")
    steps(w, args.steps, label="reference: compiled regions, no offload")
    uncompile_blocks(w.model)
    with offload(w.model, memory_budget=int(args.budget), compile=True) as cache:
        steps(w, 12, label="budget warm-up (profiling, planning)")
        print("plan:", cache.plan.as_dict() if cache.plan is not None else None, flush=True)
        steps(w, args.steps, label="budget: planned steps")
        gc.collect()
        gc.disable()
        steps(w, args.steps, label="budget: planned steps, gc off")
        gc.enable()
        prof = cProfile.Profile()
        steps(w, 5, label="budget: cProfile", prof=prof)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:9000])
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats("datapath", 30)
        print(s.getvalue()[:9000])
        st = cache.stats
        print(f"stats: packs {st.packs} quiet {st.packs_quiet} unpacks {st.unpacks} records {st.records}", flush=True)
        # the module hooks alone: identity saved-tensor hooks pushed over the cache's (the innermost pair runs)
        steps(w, args.steps, ctx=lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
              label="budget: identity saved-tensor hooks")
    compile_blocks(w.model)
    steps(w, args.steps, label="reference again")
    uncompile_blocks(w.model)
    return 0


def _between() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def sequence(w, budgets: list[float], n: int) -> int:
    steps(w, 4, label="keep (eager) warm-up")
    steps(w, 6, label="keep (eager)")
    _between()
    compile_blocks(w.model)
    steps(w, 3, label="reference warm-up")
    steps(w, n, label="reference: compiled regions, no offload")
    uncompile_blocks(w.model)
    _between()
    for b in budgets:
        with offload(w.model, memory_budget=int(b), compile=True) as cache:
            steps(w, 10, label=f"budget {b / 1e9:.2f} GB warm-up")
            print("plan:", cache.plan.as_dict() if cache.plan is not None else None, flush=True)
            steps(w, n, label=f"budget {b / 1e9:.2f} GB planned")
            torch.cuda.empty_cache()
            steps(w, n, label=f"budget {b / 1e9:.2f} GB planned, after empty_cache")
        _between()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
