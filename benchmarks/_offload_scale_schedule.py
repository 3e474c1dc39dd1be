"""B6's schedule: which method runs at which lengths, in what order, within the run's time budget.

`run_schedule(bench)` drives one `benchmarks.offload_scale.Bench` (its ``attempt`` measures one method at one
length and records it): each entry a method over some lengths, in the order that answers the bar first; a method's
ladder of lengths stops at the first OOM or failure; work the time budget cannot hold is skipped and recorded.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table
from benchmarks._llama8b import causal_lm
from benchmarks._offload_scale_args import METHODS
from benchmarks._offload_scale_report import bars, plot

MARGIN = 2 << 30   # the GPU's memory less this: datapath's budget where it is asked for the longest sequence


def estimate(bench: Any, seq: int, steps: int) -> float:
    """Seconds ``steps`` steps at ``seq`` are expected to take: checkpointing's measured step at the nearest
    length, scaled by (length ratio)^1.3 (0 before any measurement)."""
    known = {r["seq"]: r["step_s"] for r in bench.records if r["method"] == "checkpoint" and r.get("step_s")}
    if not known:
        return 0.0
    near = min(known, key=lambda s: abs(s - seq))
    return steps * known[near] * (seq / near) ** 1.3


def ladder(bench: Any, method: str, seqs: list[int], budget: Callable[[int], int | None] | None = None,
           loss_fn: Any = None, **kw: Any) -> int | None:
    """``method`` over ``seqs`` ascending, stopped at the first OOM or failure (for good: a later call for the
    same method and budget kind runs nothing; a budget refused at one length goes on to the next, each length
    having a budget of its own); the longest length that trained."""
    a = bench.args
    timed = {int(s) for s in a.timed.split(",") if s}
    key = (method, kw.get("budget_of"), kw.get("activation_memory_budget"))
    best = None
    for seq in seqs:
        if key in bench.stopped:
            break
        steps = (a.steps + a.warmup if seq in timed else 1) + (seq == a.check_seq) + \
            (a.budget_warmup + (0 if seq in timed else 1) if method == "datapath-budget" else 0)
        est = estimate(bench, seq, steps) * (1.5 if method in ("datapath-all", "datapath-budget", "save_on_cpu",
                                                              "checkpoint_offload") else 1.0)
        spent = bench.spent()
        if spent + est > a.time_budget:
            bench.skip(method, seq, f"time budget of the run ({est:.0f} s expected, "
                                    f"{a.time_budget - spent:.0f} s left)", **kw)
            break
        b = budget(seq) if budget is not None else None
        if budget is not None and b is None:
            continue
        r = bench.attempt(method, seq, b, seq in timed, check=seq == a.check_seq, loss_fn=loss_fn, **kw)
        if r["status"] == "error" and budget is not None:
            continue  # a budget of its own at each length: refused at one, it may be met at the next
        if r["status"] != "ok":
            bench.stopped.add(key)
            break
        if method == "checkpoint":
            bench.ckpt_peak[seq] = r["peak_gb"]
        best = seq
    return best


def run_schedule(bench: Any) -> None:
    """The schedule: each entry a method over some lengths, in the order that answers the bar first (a later
    entry of a method continues its ladder unless an earlier one stopped it)."""
    a = bench.args
    bench.prime()
    seqs = [int(s) for s in a.seqs.split(",")]
    timed = sorted(int(s) for s in a.timed.split(",") if s)
    methods = [m for m in a.methods.split(",") if m]
    cuda = bench.device.type == "cuda"
    capacity = (torch.cuda.get_device_properties(bench.device).total_memory - MARGIN) if cuda else None
    upto = [s for s in seqs if s <= max(timed)]
    beyond = [s for s in seqs if s > max(timed)]
    small = [s for s in seqs if s <= min(timed)]
    first = a.check_seq if a.check_seq > 0 else seqs[0]  # the one length of the single-length methods
    budgets = {"checkpoint": ("datapath-budget", sorted({first, *timed}), "checkpoint peak"),
               "device": ("datapath-budget", [s for s in seqs if s >= max(timed)], "device memory")}
    schedule: list[tuple[str, list[int], str | None]] = [
        ("checkpoint", upto, None), ("keep", seqs, None),
        *(budgets[k] for k in a.datapath_budgets.split(",") if k),
        ("checkpoint", beyond, None), ("selective_checkpoint", seqs, None),
        ("datapath-all", small, None), ("checkpoint_offload", [first] + beyond, None),
        ("save_on_cpu", seqs[:1], None), ("torchtune", [first], None),
        ("compile_budget", sorted({first, *timed}), None), ("compiler_offload", [first], None),
        ("checkpoint_compiled", sorted({first, *timed}), None)]
    if not cuda:  # the CPU check: every length of every method
        schedule = [(m, [first] if m == "datapath-budget" else seqs,
                     "checkpoint peak" if m == "datapath-budget" else None) for m in METHODS]
    for m, ms, of in schedule:
        if m not in methods or not ms:
            continue
        if m in ("save_on_cpu", "checkpoint_offload", "torchtune") and bench.dist and not cuda:
            bench.skip(m, ms[0], "not in the CPU check of the FSDP2 path")
        elif m == "torchtune" and (bench.tt_cls is None or not cuda):
            bench.skip(m, ms[0], bench.tt_why or "needs CUDA")
        elif m == "datapath-budget" and of == "checkpoint peak":
            ladder(bench, m, ms, budget=lambda s: int(bench.ckpt_peak[s] * 1e9) if s in bench.ckpt_peak else None,
                   budget_of=of)
        elif m == "datapath-budget":
            if capacity is not None:
                ladder(bench, m, ms, budget=lambda s: capacity, budget_of=of)
        elif m in ("compile_budget", "compiler_offload", "checkpoint_compiled"):
            compiled(bench, m, ms)
        else:
            ladder(bench, m, ms)
    if bench.rank == 0:  # every rank holds the same records (times and peaks gathered): one writes them
        bench.save(partial=False)
        if any(r.get("tokens_per_s") for r in bench.records):
            plot(bench.records, RESULTS_DIR / f"{a.name}.png")
        print_table([{k: r.get(k) for k in ("setting", "method", "budget_gb", "tokens_per_s", "peak_gb", "mfu",
                                            "grads_match", "oom", "status")} for r in bench.records])
        print_table(bars(bench.records))


def compiled(bench: Any, method: str, seqs: list[int]) -> None:
    """Each decoder layer compiled (``torch.compile`` regional) with an activation memory budget
    (``compile_budget``), with the compiler's activation offloading (``compiler_offload``), or inside Hugging
    Face's checkpointing of the layer (``checkpoint_compiled``)."""
    import torch._functorch.config as fconfig  # noqa: PLC0415

    a = bench.args
    if bench.device.type != "cuda":
        bench.skip(method, seqs[0], "needs CUDA (inductor's GPU kernels)")
        return
    if method == "compiler_offload":
        from torch.utils.checkpoint import CheckpointPolicy  # noqa: PLC0415

        if "enable_activation_offloading" not in fconfig.get_config_copy() or \
                not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
            bench.skip(method, a.check_seq, f"torch {torch.__version__} has no compiler activation offloading "
                                            "(functorch config enable_activation_offloading, "
                                            "CheckpointPolicy.MUST_CPU_OFFLOAD)")
            return
        bench.skip(method, a.check_seq, "not wired: it needs a selective-checkpointing policy marking each "
                                        "tensor MUST_CPU_OFFLOAD inside compiled regions; not run this time")
        return
    if bench.spent() + a.compile_cost > a.time_budget:
        bench.skip(method, a.check_seq, "time budget of the run (compiling 32 layers' regions costs "
                                        f"~{a.compile_cost:.0f} s)")
        return
    layers = list(causal_lm(bench.lm).model.layers)
    if method == "checkpoint_compiled":
        torch._dynamo.reset()
        for layer in layers:
            layer.compile()
        try:
            ladder(bench, method, seqs, regional=True)
        finally:
            for layer in layers:
                layer._compiled_call_impl = None
        return
    for budget in [float(b) for b in a.compile_budgets.split(",") if b]:
        torch._dynamo.reset()
        fconfig.activation_memory_budget = budget
        for layer in layers:
            layer.compile()
        try:
            ladder(bench, method, seqs, activation_memory_budget=budget, regional=True)
        finally:
            for layer in layers:
                layer._compiled_call_impl = None  # what nn.Module.compile set: the eager call again
            fconfig.activation_memory_budget = 1.0
