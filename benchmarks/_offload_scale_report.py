"""B6's records turned into results (`benchmarks/offload_scale.py`): the bar checks, the plot, the completion of a
run that ended early."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, write_result


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference of two gradient lists over the largest magnitude in ``b``."""
    scale = max((float(y.abs().max()) for y in b if y.numel()), default=0.0) or 1.0
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if y.numel()), default=0.0) / scale


def bars(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's checks: datapath's longest length >= checkpointing's; at checkpointing's longest length,
    datapath's tokens/s >= 1.15x checkpointing's and >= the fastest peer that fits datapath's budget there
    (checkpointing's peak: a peer's peak <= 1.03x it, as a budget is held), named; every datapath budget held
    (peak <= 1.03 budget). The fastest peer over that memory is named beside them, not counted: at a budget a
    peer over it is not an option (on a 141 GB H200 even keeping everything runs)."""
    ok = [r for r in records if r.get("status") == "ok"]
    out = []
    for mode in dict.fromkeys(r["setting"].split("-")[0] for r in records):
        rs = [r for r in ok if r["setting"].startswith(mode)]
        ck = max((r["seq"] for r in rs if r["method"] == "checkpoint"), default=None)
        dp = max((r["seq"] for r in rs if r["method"].startswith("datapath")), default=None)
        out.append({"mode": mode, "check": "longest datapath >= checkpoint", "checkpoint": ck, "datapath": dp,
                    "met": ck is not None and dp is not None and dp >= ck})
        if ck is not None:
            c = next(r for r in rs if r["method"] == "checkpoint" and r["seq"] == ck)
            d = max((r for r in rs if r["method"].startswith("datapath") and r["seq"] == ck),
                    key=lambda r: r["tokens_per_s"], default=None)
            out.append({"mode": mode, "check": f"tokens/s at {ck} >= 1.15x checkpoint",
                        "ratio": d["tokens_per_s"] / c["tokens_per_s"] if d else None,
                        "met": bool(d) and d["tokens_per_s"] >= 1.15 * c["tokens_per_s"]})
            limit = 1.03 * c["peak_gb"]
            peers = [r for r in rs if not r["method"].startswith("datapath") and r["method"] != "checkpoint"
                     and r["seq"] == ck and r.get("tokens_per_s")]
            for within in (True, False):
                group = [r for r in peers if (r["peak_gb"] <= limit) == within]
                peer = max(group, key=lambda r: r["tokens_per_s"], default=None)
                if peer is None:
                    continue
                name = peer["method"] + (f" {peer['activation_memory_budget']}"
                                         if peer.get("activation_memory_budget") is not None else "")
                faster = bool(d) and d["tokens_per_s"] >= peer["tokens_per_s"]
                out.append({"mode": mode, "ratio": d["tokens_per_s"] / peer["tokens_per_s"] if d else None,
                            **({"check": f"tokens/s at {ck} >= the fastest peer within the budget ({name})",
                                "met": faster} if within else
                               {"check": f"(not counted) the fastest peer over the budget: {name} at "
                                         f"{peer['peak_gb']:.2f} GB", "met": None})})
        held = [r["peak_gb"] <= 1.03 * r["budget_gb"] for r in rs if r["method"] == "datapath-budget"]
        out.append({"mode": mode, "check": "every budget held", "n": len(held), "met": bool(held) and all(held)})
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    keys = list(dict.fromkeys((r["method"], r.get("budget_of"), r.get("activation_memory_budget"))
                              for r in records))
    failed: list[dict[str, Any]] = []
    for method, of, amb in keys:
        rs = sorted((r for r in records if (r["method"], r.get("budget_of"), r.get("activation_memory_budget"))
                     == (method, of, amb)), key=lambda r: r["seq"])
        label = method + (f" ({of})" if of else "") + (f" {amb}" if amb is not None else "")
        ok = [r for r in rs if r.get("tokens_per_s")]
        if ok:
            line = ax1.plot([r["seq"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=label)[0]
            ax2.plot([r["seq"] for r in ok], [r["peak_gb"] for r in ok], "o-", color=line.get_color(), label=label)
            color = line.get_color()
        else:
            color = "black"
        for i, r in enumerate(r for r in rs if r.get("oom") or r.get("status") == "error"):
            y = -250.0 * (1 + len(failed))
            failed.append(r)
            ax1.scatter([r["seq"]], [y], marker="x" if r.get("oom") else "s", color=color, s=50)
            ax1.annotate(label + (" OOM" if r.get("oom") else " refused"), (r["seq"], y), fontsize=6,
                         xytext=(5, -3), textcoords="offset points")
    ax1.set_xscale("log", base=2)
    ax2.set_xscale("log", base=2)
    ax1.set_xlabel("sequence length (below 0: x out of memory, square refused; single steps off the timed lengths)")
    ax1.set_ylabel("tokens/s per GPU")
    ax2.set_xlabel("sequence length")
    ax2.set_ylabel("peak allocated (GB)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    dev = next((r["device"] for r in records if r.get("device")), "")
    fig.suptitle(f"B6 offloading at 8B scale ({records[0]['setting'].rsplit('-', 1)[0] if records else ''}) on {dev}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def finish(args: argparse.Namespace) -> int:
    """Complete the records of a run that ended early: every method in ``--methods`` without a record gets one
    (``status: "not run"``, ``--reason``); the run's other fields are kept, ``partial`` stays true."""
    doc = json.loads(Path(args.finish).read_text())
    records = doc["records"]
    done = {r["method"] for r in records}
    dev = next((r["device"] for r in records if r.get("device")), None)
    first = min((r["seq"] for r in records), default=args.check_seq)
    mode = args.mode
    for m in [m for m in args.methods.split(",") if m and m not in done]:
        why = args.reason
        if m == "torchtune" and doc.get("torchtune"):  # it never imports here: that is the reason, not the end
            why = f"torchtune does not import on the machine of the run: {doc['torchtune']}"
        records.append({"setting": f"{mode}-8b-{first // 1024}k", "method": m, "budget_gb": None,
                        "tokens_per_s": None, "peak_gb": None, "peak_gb_per_rank": None, "mfu": None,
                        "grads_match": None, "seq": first, "device": dev, "oom": False, "status": "not run",
                        "reason": why})
    keep = {k: v for k, v in doc.items() if k not in ("benchmark", "date", "command", "machine", "records")}
    # the run's machine, command and date stay; this completion is named beside them
    keep.update(machine=doc.get("machine"), command=doc.get("command"), date=doc.get("date"),
                finished_by=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    write_result(args.name, {**keep, "records": records, "bars": bars(records)})
    plot(records, RESULTS_DIR / f"{args.name}.png")
    print_table([{k: r.get(k) for k in ("setting", "method", "budget_gb", "tokens_per_s", "peak_gb", "mfu",
                                        "grads_match", "oom", "status")} for r in records])
    print_table(bars(records))
    return 0


def plan_brief(plan: Any) -> dict[str, Any] | None:
    """A budget plan in a few numbers (None before the first plan: the profiled step)."""
    if plan is None or not hasattr(plan, "as_dict"):
        return None
    d = plan.as_dict()
    return {"offload_gb": d["offload_bytes"] / 1e9, "recompute_blocks": len(d["recompute"]),
            "cut_segment": d["cut_segment"], "predicted_peak_gb": d["predicted_peak"] / 1e9,
            "attention_saved": len(d["attention_saved"]), "attention_offloaded": len(d.get("attention_offloaded", []))}


def cache_record(cache: Any, method: str, steps: int) -> dict[str, Any]:
    """What a datapath method's cache measured over ``steps`` steps (empty for the peers): bytes offloaded a step,
    store bandwidths, the pacing lead (units); for ``datapath-budget`` the planned steps' peaks, the planner's host
    time, the plan and trials, the targets, the profile planned from, the attention gains (per block: GB kept,
    seconds saved) and what its attention store moved."""
    if cache is None:
        return {}
    st = cache.stats
    extra: dict[str, Any] = {"offloaded_gb_per_step": st.bytes_offloaded / 1e9 / max(1, steps),
                             "write_GBps": st.write_bandwidth / 1e9, "read_GBps": st.read_bandwidth / 1e9,
                             "pace": cache.config.flow.pace,
                             "compile": cache.config.select.compile_options is not None,
                             "partition_compiled": cache.config.flow.partition_compiled}
    pol = getattr(cache, "policy", None)
    if method == "datapath-budget" and pol is not None:
        extra["step_peaks_gb"] = [p / 1e9 for p in getattr(pol, "peaks", [])]
        extra["planning_s"] = getattr(pol, "planning_s", None)  # the planner's host time, all plans
        extra["steps_unhooked"] = st.records_unhooked  # planned steps that stored nothing: no hooks
        plan = getattr(cache, "plan", None)
        extra["plan"] = plan.as_dict() if plan is not None and hasattr(plan, "as_dict") else None
        extra["plan_trials"] = getattr(pol, "trials", None)
        extra["targets_gb"] = {"store": pol.target / 1e9, "keep": pol.keep_target / 1e9}
        prof = getattr(pol, "profile", None)  # what the plans were made from: `plan_budget` can be re-run on it
        extra["budget_profile"] = None if prof is None else dataclasses.asdict(prof)
        att = getattr(pol, "attention", None)
        if att is not None:
            extra["attention_gains"] = {str(b): [nb / 1e9, sec] for b, (nb, sec) in att.gains().items()}
        ast = getattr(pol, "attention_store", None)  # attention outputs offloaded: GB over the whole run
        if ast is not None:
            extra["attention_store_gb"] = {"stored": ast.stored_bytes / 1e9, "fetched": ast.fetched_bytes / 1e9,
                                           "prefetched": ast.prefetched_bytes / 1e9, "kept": ast.kept_bytes / 1e9}
    return extra
