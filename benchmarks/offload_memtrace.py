"""Where does the activation peak form?  A B4 model under several TensorCache settings, with a memory trace.

Run: PYTHONPATH=src:. python benchmarks/offload_memtrace.py --model llama --variants keep,host-all \
         --extra '{"all-1G": {"target": "host", "max_inflight_bytes": 1e9}}'
Budget variants ({"memory_budget": ...}) need --no-trace: the trace resets the peak counters the budget reads.

For each variant: step time, activation peak, bytes offloaded/forwarded, the plan, and
the allocator's memory (CPU order, which is what the peak counts) at every leaf module's
forward and backward, so the moment of the peak can be named.  A diagnostic for tuning
the offloader on the GPU machine; B4 itself is benchmarks/offload.py.

Run: PYTHONPATH=src:. python benchmarks/offload_memtrace.py [--variants a,b,...] [--hidden 8192 ...]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from benchmarks.offload import build


def pick_ssd_dir(requested: str | None) -> str:
    for c in [requested] if requested else ["/var/tmp", "/tmp", os.getcwd()]:
        if c and os.path.isdir(c) and os.access(c, os.W_OK):
            return c
    return requested or "/tmp"

VARIANTS: dict[str, dict[str, Any]] = {
    "keep": {},
    "host-all": dict(target="host"),
    "host-adaptive-blocks": dict(target="host", policy="adaptive", units="blocks"),
    "host-adaptive-leaves": dict(target="host", policy="adaptive", units="leaves"),
    "host-all-leaves": dict(target="host", policy="all", units="leaves", keep_last_modules=0),
    "host-all-leaves-k2": dict(target="host", policy="all", units="leaves", keep_last_modules=2),
    "ssd-adaptive-blocks": dict(target="ssd", policy="adaptive", units="blocks"),
    "ssd-adaptive-leaves": dict(target="ssd", policy="adaptive", units="leaves"),
}


class MemTrace:
    """memory_allocated and the peak since the previous point, at every leaf module's forward and backward."""

    def __init__(self, model: nn.Module) -> None:
        self.points: list[tuple[str, float, int, int]] = []
        self.t0 = time.perf_counter()
        self.handles = []
        for name, m in model.named_modules():
            if m is model or not any(True for _ in m.parameters(recurse=False)):
                continue
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._fwd, name)))
            self.handles.append(m.register_forward_hook(functools.partial(self._post, name)))

    def _point(self, label: str) -> None:
        self.points.append((label, time.perf_counter() - self.t0, torch.cuda.memory_allocated(),
                            torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()

    def _fwd(self, name: str, m: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() == -1:
            self._point(f"F {name}")

    def _post(self, name: str, m: nn.Module, args: Any, out: Any) -> None:
        if torch._C._current_graph_task_id() != -1 or not isinstance(out, torch.Tensor) or out.grad_fn is None:
            return
        out.grad_fn.register_prehook(lambda g, n=name: self._point(f"B {n}"))

    def reset(self) -> None:
        self.points.clear()
        self.t0 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats()

    def summary(self, base: int) -> dict[str, Any]:
        # the peak since the previous point is attributed to the interval ending at this point
        pts = [(lab, t, (a - base) / 1e9, (p - base) / 1e9) for lab, t, a, p in self.points]
        worst = max(range(len(pts)), key=lambda i: pts[i][3]) if pts else 0
        first_b = next((i for i, p in enumerate(pts) if p[0].startswith("B ")), None)
        return {"n": len(pts), "peak_interval_end": pts[worst][0] if pts else None,
                "peak_interval_prev": pts[worst - 1][0] if worst else None,
                "peak_GB": pts[worst][3] if pts else None,
                "at_first_backward_GB": pts[first_b][2] if first_b is not None else None,
                "trace": [[lab, round(t * 1e3, 2), round(a, 3), round(p, 3)] for lab, t, a, p in pts]}


def run_variant(name: str, spec: dict[str, Any], w: Any, ssd_dir: str, warmup: int, steps: int,
                trace_on: bool = True) -> dict[str, Any]:
    from datapath.offload import TensorCache

    cache = None
    if spec:
        kw = {k: v for k, v in spec.items() if k not in ("target", "units")}
        cache = TensorCache(spec["target"], ssd_dir if spec["target"] == "ssd" else None, **kw)
    model = w.model
    if cache is not None:
        cache.attach(model, units=spec.get("units"))
    trace = MemTrace(model if trace_on else nn.Module())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    times, peaks, summaries = [], [], []
    try:
        for i in range(warmup + steps):
            if cache is not None and i == warmup:
                cache.reset_stats()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            trace.reset()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            ctx = cache if cache is not None else contextlib.nullcontext()
            opt.zero_grad(set_to_none=True)  # gradients allocated in backward, as B4 measures
            with ctx:
                loss = w.loss(model, w.batch)
                loss.backward()
            opt.step()
            b.record()
            b.synchronize()
            del loss
            peak = max([p for *_, p in trace.points] + [torch.cuda.max_memory_allocated()])
            base = 0  # peaks include parameters and gradients (allocated in backward)
            if i >= warmup:
                times.append(a.elapsed_time(b))
                peaks.append(peak - base)
                summaries.append(trace.summary(base))
        out: dict[str, Any] = {"variant": name, "spec": spec, "step_ms": statistics.median(times),
                               "step_ms_all": times, "act_peak_GB": max(peaks) / 1e9, "peak_GB": max(peaks) / 1e9}
        worst = max(range(len(peaks)), key=lambda i: peaks[i])
        out["memtrace"] = summaries[worst]
        if cache is not None:
            cache.wait_io()
            st = cache.stats
            out.update(off_GB=st.bytes_offloaded / steps / 1e9, fwd_GB=st.bytes_forwarded / steps / 1e9,
                       queued_GB=st.bytes_queued / steps / 1e9, loaded_GB=st.bytes_loaded / steps / 1e9,
                       wait_ms=st.unpack_wait_seconds * 1e3 / steps, write_GBps=st.write_bandwidth / 1e9,
                       read_GBps=st.read_bandwidth / 1e9, engine=cache.engine,
                       plan=cache.plan.as_dict() if cache.plan is not None else None,
                       step_peaks_GB=[p / 1e9 for p in getattr(cache.policy, "peaks", [])])
        return out
    finally:
        for h in trace.handles:
            h.remove()
        if cache is not None:
            cache.close()
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model", default="gpt-h8192", help="gpt-h8192, llama or gpt2 (B4's shapes)")
    ap.add_argument("--no-trace", action="store_true", help="step peaks only (for memory_budget variants)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ssd-dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--extra", default=None, help='JSON dict of more variants: {"name": {TensorCache kwargs}}')
    ap.add_argument("--log", action="store_true", help="log the offloader's decisions (INFO)")
    args = ap.parse_args()
    if args.log:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("datapath.offload").setLevel(logging.INFO)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    variants = dict(VARIANTS)
    if args.extra:
        variants.update(json.loads(args.extra))
    w = build(args.model, torch.device("cuda"), False)
    ssd_dir = pick_ssd_dir(args.ssd_dir)
    results = []
    for name in [v for v in args.variants.split(",") if v]:
        r = run_variant(name, variants[name], w, ssd_dir, args.warmup, args.steps, not args.no_trace)
        results.append(r)
        m = r["memtrace"]
        print(f"{name:24s} {r['step_ms']:7.1f} ms act {r['act_peak_GB']:5.2f} GB off {r.get('off_GB', 0):5.2f} "
              f"fwd {r.get('fwd_GB', 0):5.2f} q {r.get('queued_GB', 0):5.2f} wait {r.get('wait_ms', 0):5.1f} "
              f"w {r.get('write_GBps', 0):5.1f} | peak in ({m['peak_interval_prev']} -> {m['peak_interval_end']}) "
              f"{m['peak_GB']:.2f}, at 1st bwd {m['at_first_backward_GB']}", flush=True)
        if r.get("plan"):
            print("    plan", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r["plan"].items()})
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
