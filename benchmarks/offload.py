"""B4: activation offloading on real models, against every peer, in one run (one process per model).

Models (bf16, built from configs, no downloads): HF Llama (hidden 4096, 6 layers, 32 heads,
intermediate 11008, vocab 32000; micro-batch 4, sequence 2048), HF GPT-2 (n_embd 1600, 12
layers; micro-batch 8, sequence 1024) and the GPT stack H8192 L4 (micro-batch 8, sequence 1024).
Methods: keep; checkpoint (HF gradient checkpointing, non-reentrant; layerwise for the stack);
save_on_cpu (pin_memory=True); torchtune (OffloadActivations, when it imports); compile_budget
(torch.compile of the whole model with each ``--compile-budgets`` activation_memory_budget, and
PyTorch's regional compilation recipe, each block's module compiled, ``regional: true``);
datapath-all (``offload(model)``, defaults);
datapath-budget (``offload(model, memory_budget=B, compile=True)``, B at 25/50/75/100% of the
way from keep's peak down to checkpoint's; ``--datapath-compile eager|both`` for the eager
method, ``compiled`` in each record; a budget's bar check takes datapath's faster mode and
names it).  Per step: zero_grad(set_to_none=True) (gradients are allocated in backward),
forward, backward, SGD step; peak = torch.cuda.max_memory_allocated() over the step;
step time = median of ``--steps`` after ``--warmup`` (more warm-up for datapath-budget: it profiles
and plans).  grads_identical: one extra step per method from the same weights, batch and seed,
gradients compared bit for bit (a per-parameter hash) with keep's (compiled datapath: with datapath's
compiled regions' (`compile_blocks`: blocks, output head, loss) without offloading; compiled kernels
differ from eager ones).

With ``--isolate`` each method runs in a process of its own, one after another: a fresh CUDA
context, caching allocator and compile state, no thread, hook or pinned pool of an earlier method
left behind; what later methods need from earlier ones (keep's gradient hash and peak,
checkpoint's peak, the compiled reference's hash) is passed on between the processes.  It costs a
start and a compile per method (GPT-2: 567 s on an H100 without reaching the whole-model compile
peers, against ~240 s for everything in one process), so it is not the default.

Writes benchmarks/results/offload.json (a list of records {model, method, budget_gb, step_ms,
peak_gb, grads_identical, device, ...}) and offload.png (step time against peak per model).
Run: PYTHONPATH=src:. python benchmarks/offload.py [--models llama,gpt2,gpt-h8192] [--cpu-smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS_DIR, print_table  # noqa: E402
from benchmarks._offload_report import bars, merge, plot, save  # noqa: E402
from benchmarks._offload_workloads import Workload, build, torchtune_offload  # noqa: E402
from datapath.offload import auto_blocks, compile_blocks, offload, uncompile_blocks  # noqa: E402
from datapath.offload.memory_meter import CpuMeter  # noqa: E402

METHODS = ["keep", "checkpoint", "save_on_cpu", "torchtune", "datapath-all", "datapath-budget", "compile_budget"]
FRACTIONS = (0.25, 0.5, 0.75, 1.0)   # of the way from keep's peak down to checkpoint's
COMPILE_BUDGETS = "1.0,0.5"          # torch._functorch.config.activation_memory_budget values measured


def grad_hash(model: nn.Module) -> list[list[int]]:
    """Per parameter [sum of the gradient's bits, position-weighted sum]: equal iff bit-identical, in practice
    (lists: the same after a JSON round trip between the processes of a run)."""
    out = []
    for p in model.parameters():
        if p.grad is None:
            out.append([0, 0])
            continue
        bits = p.grad.detach().reshape(-1).view(torch.int16 if p.grad.element_size() == 2 else torch.int32)
        bits = bits.to(torch.int64)
        w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 8191 + 1
        out.append([int(bits.sum()), int((bits * w).sum())])
    return out


@contextlib.contextmanager
def method_context(w: Workload, method: str, budget: int | None, tt_cls: Any, compiled: bool = False
                   ) -> Iterator[Callable[[], Any]]:
    """Set the method up around the steps; yields a function giving the per-step context."""
    model = w.model
    if method == "compile_datapath":  # datapath's compiled regions without offloading: the compiled reference
        compile_blocks(model)
        try:
            yield contextlib.nullcontext
        finally:
            uncompile_blocks(model)
        return
    if method == "compile_regional":  # PyTorch's regional compilation recipe: each block's module compiled
        blocks = auto_blocks(model)
        for b in blocks:
            b.compile()
        try:
            yield contextlib.nullcontext
        finally:
            for b in blocks:
                b._compiled_call_impl = None  # what nn.Module.compile set: the eager call again
        return
    if method == "checkpoint":
        w.recompute(True)
        try:
            yield contextlib.nullcontext
        finally:
            w.recompute(False)
    elif method == "save_on_cpu":
        yield lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    elif method == "torchtune":
        yield lambda: tt_cls(use_streams=True)
    elif method in ("datapath-all", "datapath-budget"):
        cpu = next(model.parameters()).device.type == "cpu"
        opts: dict[str, Any] = dict(offload_cpu_tensors=True, min_bytes=4096) if cpu else {}
        if compiled:
            opts["compile"] = True
        with offload(model, memory_budget=budget, **opts) as cache:
            w.cache = cache  # type: ignore[attr-defined]
            yield contextlib.nullcontext
    else:
        yield contextlib.nullcontext


def run_method(w: Workload, method: str, args: argparse.Namespace, budget: int | None, tt_cls: Any,
               ref_hash: list | None, step_fn: Callable[[], torch.Tensor] | None = None,
               check_only: bool = False, compiled: bool = False) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    model = w.model
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every method starts from the same weights
    # datapath-budget: runs everything offloaded, profiles a step, plans, tries plans that offload less,
    # corrects: more warm-up steps
    warmup = (args.warmup + (7 if method == "datapath-budget" else 0)
              + (1 if compiled or method.startswith("compile_") else 0))
    times, peaks = [], []
    w.cache = None  # type: ignore[attr-defined]
    fn = step_fn or (lambda: w.loss(model, w.batch))
    with method_context(w, method, budget, tt_cls, compiled) as make_ctx:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with make_ctx():
                loss = fn()
                loss.backward()
            opt.step()

        meter = None if cuda else CpuMeter(sum(t.numel() * t.element_size() for t in model.parameters()))
        for i in range(0 if check_only else warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:  # --cpu-smoke: bytes of the storages ops create in the step (the budget's CPU measure)
                meter.lap()
            t0 = time.perf_counter()
            with meter or contextlib.nullcontext():
                step()
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
                peaks.append(torch.cuda.max_memory_allocated() if cuda else meter.lap())
        h = None
        if method != "compile_budget":  # the whole model compiled: its own kernels, no reference to compare with
            # the check step: same weights, batch and seed; attention through SDPA's math backend, the one
            # whose backward is deterministic (flash attention's accumulates with atomics).  Compiled blocks
            # keep the attention kernel they were traced with: for them the step runs with deterministic
            # algorithms on (flash attention's deterministic backward; cuBLAS with CUBLAS_WORKSPACE_CONFIG)
            torch.manual_seed(1234)
            opt.zero_grad(set_to_none=True)
            det = compiled or method in ("compile_regional", "compile_datapath")
            try:
                torch.use_deterministic_algorithms(det)
                with make_ctx(), sdpa_kernel(SDPBackend.MATH):
                    fn().backward()
                h = grad_hash(model)
            finally:
                torch.use_deterministic_algorithms(False)
        cache = getattr(w, "cache", None)
        extra: dict[str, Any] = {}
        if cache is not None:
            st = cache.stats
            extra = {"offloaded_gb_per_step": st.bytes_offloaded / 1e9 / (warmup + args.steps + 1),
                     "store_wait_s": st.store_wait_seconds, "unpack_wait_s": st.unpack_wait_seconds,
                     "write_GBps": st.write_bandwidth / 1e9, "read_GBps": st.read_bandwidth / 1e9,
                     "plan": cache.plan.as_dict() if cache.plan is not None and hasattr(cache.plan, "as_dict")
                     else None}
            if method == "datapath-budget":
                extra["step_peaks_gb"] = [p / 1e9 for p in cache.policy.peaks]
                extra["plan_trials"] = cache.policy.trials
                extra["planning_s"] = cache.policy.planning_s  # the planner's host time, every plan it made
    opt.zero_grad(set_to_none=True)

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if check_only:
        return {"hash": h}
    return {"step_ms": statistics.median(times), "steps_ms": times, "peak_gb": max(peaks) / 1e9,
            # compiled regions without offloading: their own kernels, nothing to compare with (their hash is the
            # reference of compiled datapath)
            "grads_identical": None if ref_hash is None or h is None or method == "compile_regional"
            else h == ref_hash, "hash": h, **extra}


def stages(args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    """The methods of a model's run, in order; each a stage (with ``--isolate``, a process of its own)."""
    methods = [m for m in args.methods.split(",") if m]
    out: list[dict[str, Any]] = [{"kind": "keep"}]
    if "checkpoint" in methods:
        out.append({"kind": "method", "method": "checkpoint"})
    out += [{"kind": "method", "method": m} for m in ("save_on_cpu", "torchtune", "datapath-all") if m in methods]
    ways = {"compiled": [True], "eager": [False], "both": [True, False]}[args.datapath_compile] if cuda else [False]
    if "datapath-budget" in methods and "checkpoint" in methods:
        for compiled in ways:
            if compiled:
                # a peer: PyTorch's regional compilation (each block compiled); and the gradients' reference:
                # datapath's compiled regions (blocks, head, loss) without offloading (timed, printed, no record)
                out.append({"kind": "method", "method": "compile_regional", "name": "compile_budget",
                            "kw": {"activation_memory_budget": 1.0, "regional": True}})
                out.append({"kind": "compiled_ref"})
            out += [{"kind": "budget", "fraction": f, "compiled": compiled} for f in FRACTIONS]
    if "compile_budget" in methods and cuda:
        out += [{"kind": "whole", "budget": float(b)} for b in args.compile_budgets.split(",") if b]
    return out


def stage_label(spec: dict[str, Any]) -> str:
    kind = spec["kind"]
    if kind == "method":
        return spec["method"]
    if kind == "budget":
        return f"datapath-budget {spec['fraction']:g}" + (" compiled" if spec["compiled"] else " eager")
    if kind == "whole":
        return f"compile_budget {spec['budget']:g}"
    return kind


def run_model(name: str, args: argparse.Namespace, only: list[int] | None = None,
              ctx: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run the stages of model ``name`` in this process (``only``: those indices; ``ctx``: what earlier stages
    measured -- keep's gradient hash and peak, checkpoint's peak, the compiled reference's hash -- updated here)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    cuda = device.type == "cuda"
    w = build(name, device, args.cpu_smoke)
    tt_cls, tt_why = torchtune_offload()
    records: list[dict[str, Any]] = []
    ctx = {} if ctx is None else ctx
    t_start = time.perf_counter()

    def rec(method: str, budget: float | None, **kw: Any) -> dict[str, Any]:
        r = {"model": name, "method": method, "budget_gb": None if budget is None else budget / 1e9,
             "step_ms": None, "peak_gb": None, "grads_identical": None, "device": dev_name, **kw}
        records.append(r)
        if args.out:  # written after every method: a run stopped midway keeps what it measured
            Path(args.out).write_text(json.dumps(records))
        print(f"  {name} {method} {'' if budget is None else f'budget {budget / 1e9:.2f} GB '}"
              f"{r.get('status', 'ok')}: {r.get('step_ms') or 0:.1f} ms, peak {r.get('peak_gb') or 0:.2f} GB, "
              f"grads identical {r.get('grads_identical')}", flush=True)
        return r

    def attempt(method: str, budget: float | None = None, step_fn: Any = None, compiled: bool = False,
                ref: list | None = None, label: str | None = None, **kw: Any) -> dict[str, Any] | None:
        label = label or method
        if method == "datapath-budget":
            kw["compiled"] = compiled
        if only is None and time.perf_counter() - t_start > args.time_budget:
            rec(label, budget, status="skipped", reason="time budget of the run", **kw)
            return None
        try:
            out = run_method(w, method, args, None if budget is None else int(budget), tt_cls,
                             ctx.get("ref_hash") if ref is None else ref, step_fn, compiled=compiled)
        except Exception as exc:  # noqa: BLE001 - one broken method must not lose the others
            traceback.print_exc()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            rec(label, budget, status="error", reason=f"{type(exc).__name__}: {exc}"[:400], **kw)
            return None
        h = out.pop("hash")
        r = rec(label, budget, status="ok", **out, **kw)
        r["_hash"] = h
        return r

    specs = stages(args, cuda)
    for i, spec in enumerate(specs):
        if only is not None and i not in only:
            continue
        kind = spec["kind"]
        if kind != "keep" and "ref_hash" not in ctx:
            continue  # keep failed: nothing to compare with
        if kind == "keep":
            keep = attempt("keep")
            if keep is None:
                break
            ref_hash = run_method(w, "keep", args, None, None, None, check_only=True)["hash"]  # deterministic?
            keep["grads_identical"] = ref_hash == keep.pop("_hash")  # keep against itself
            ctx.update(ref_hash=ref_hash, keep_peak=keep["peak_gb"])
        elif kind == "method":
            m = spec["method"]
            if m == "torchtune" and (tt_cls is None or not cuda):
                rec(m, None, status="skipped", reason=tt_why or "needs CUDA")
                continue
            r = attempt(m, label=spec.get("name"), **spec.get("kw", {}))
            if r is not None and m == "checkpoint":
                ctx["ckpt_peak"] = r["peak_gb"]
        elif kind == "compiled_ref":
            try:  # timed too: its graphs must be traced outside the check step's math attention
                out = run_method(w, "compile_datapath", args, None, None, None)
                ctx["compiled_ref"] = out["hash"]
                print(f"  {name} datapath's compiled regions without offloading (the reference, not a peer): "
                      f"{out['step_ms']:.1f} ms, peak {out['peak_gb']:.2f} GB", flush=True)
            except Exception:  # noqa: BLE001 - without a reference the compiled budget records are not run
                traceback.print_exc()
                ctx.pop("compiled_ref", None)
        elif kind == "budget":
            if "ckpt_peak" not in ctx or (spec["compiled"] and "compiled_ref" not in ctx):
                continue
            hi, lo = ctx["keep_peak"] * 1e9, ctx["ckpt_peak"] * 1e9
            f = spec["fraction"]
            attempt("datapath-budget", hi - f * (hi - lo), compiled=spec["compiled"],
                    ref=ctx["compiled_ref"] if spec["compiled"] else None, fraction=f)
        elif kind == "whole":
            import torch._functorch.config as fconfig  # noqa: PLC0415

            torch._dynamo.reset()  # the partitioner reads the budget when it compiles: compile anew
            fconfig.activation_memory_budget = spec["budget"]
            whole = torch.compile(w.model)
            attempt("compile_budget", None, step_fn=lambda: w.loss(whole, w.batch),
                    activation_memory_budget=spec["budget"], regional=False)
            del whole
    for r in records:
        r.pop("_hash", None)
    if args.out:
        Path(args.out).write_text(json.dumps(records))
    return records


def run_model_isolated(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each stage of model ``name`` in a process of its own (a fresh CUDA context, allocator, compile cache in
    memory, no thread or hook of another method left behind), in order; what a stage measured that later ones
    need (keep's gradient hash and peak, checkpoint's peak, the compiled reference's hash) is passed on."""
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    specs = stages(args, cuda)
    records: list[dict[str, Any]] = []
    ctx: dict[str, Any] = {}
    t_start = time.perf_counter()
    part, ctx_path = Path(args.out).with_suffix(".stage.json"), Path(args.out).with_suffix(".ctx.json")
    for i, spec in enumerate(specs):
        if time.perf_counter() - t_start > args.time_budget:
            if spec["kind"] != "compiled_ref":
                records.append({"model": name, "method": stage_label(spec), "status": "skipped",
                                "reason": "time budget of the run", "budget_gb": None, "step_ms": None,
                                "peak_gb": None, "grads_identical": None})
            continue
        ctx_path.write_text(json.dumps(ctx))
        cmd = [sys.executable, __file__, "--one", name, "--stage", str(i), "--ctx", str(ctx_path), "--out", str(part),
               *child_args(args)]
        rc = subprocess.run(cmd).returncode
        if part.exists():
            records += json.loads(part.read_text())
            part.unlink()
        ctx = json.loads(ctx_path.read_text())
        if rc != 0:
            records.append({"model": name, "method": stage_label(spec), "status": "error",
                            "reason": f"stage process exited {rc}", "budget_gb": None, "step_ms": None,
                            "peak_gb": None, "grads_identical": None})
        Path(args.out).write_text(json.dumps(records))
    ctx_path.unlink(missing_ok=True)
    dev = next((r["device"] for r in records if r.get("device")), None)
    for r in records:  # the stages that never ran (skipped, died) name the device the others ran on
        r.setdefault("device", dev)
    return records


def child_args(args: argparse.Namespace) -> list[str]:
    """The options a child process of this run gets (besides what it runs)."""
    out = ["--methods", args.methods, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--time-budget", str(args.time_budget), "--compile-budgets", args.compile_budgets,
           "--datapath-compile", args.datapath_compile]
    if args.cpu_smoke:
        out.append("--cpu-smoke")
    if args.isolate:
        out.append("--isolate")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,gpt2,gpt-h8192")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds per model; later methods skipped")
    ap.add_argument("--compile-budgets", default=COMPILE_BUDGETS,
                    help=f"activation_memory_budget values of compile_budget [{COMPILE_BUDGETS}]")
    ap.add_argument("--datapath-compile", choices=("compiled", "eager", "both"), default="compiled",
                    help="datapath-budget with compile=True, without, or both [compiled]")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny configs on the CPU: checks the script")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="merge offload.json files of runs of different models (a model's records all come from "
                         "the last file that has it) into benchmarks/results/, with each file's meta beside it")
    ap.add_argument("--isolate", action="store_true",
                    help="each method in a process of its own (default: a model's methods in one process)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # a child: one model (or one stage of it), records to --out
        import logging  # noqa: PLC0415

        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("datapath.offload.budget").setLevel(logging.INFO)  # each plan and correction, in the log
        if args.stage is not None:
            ctx = json.loads(Path(args.ctx).read_text())
            records = run_model(args.one, args, only=[args.stage], ctx=ctx)
            Path(args.ctx).write_text(json.dumps(ctx))
        elif args.isolate:
            records = run_model_isolated(args.one, args)
        else:
            records = run_model(args.one, args)
        Path(args.out).write_text(json.dumps(records))
        return 0
    if args.merge:
        return merge(args.merge)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("B4 needs a CUDA GPU; nothing to do here (--cpu-smoke checks the script).")
        return 0
    records: list[dict[str, Any]] = []
    tmp = RESULTS_DIR / ".offload-part.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--out", str(tmp), *child_args(args)]
        print(f"== {name}", flush=True)
        path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # cuBLAS is deterministic only with a fixed workspace: the compiled methods' gradient check needs it
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **os.environ, "PYTHONPATH": path}
        rc = subprocess.run(cmd, env=env).returncode
        if tmp.exists():
            records += json.loads(tmp.read_text())
            tmp.unlink()
        if rc != 0:
            records.append({"model": name, "method": "run", "status": "error", "reason": f"child exited {rc}",
                            "budget_gb": None, "step_ms": None, "peak_gb": None, "grads_identical": None,
                            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"})
        save(records, partial=True)  # a run cut short still leaves the models measured so far
    save(records, partial=False)
    checks = bars(records)
    if any(r.get("step_ms") for r in records):
        plot(records, RESULTS_DIR / "offload.png")
    print_table([{k: r.get(k) for k in ("model", "method", "budget_gb", "step_ms", "peak_gb", "grads_identical",
                                        "status")} for r in records])
    print_table(checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
