"""B4 / SSDTrain Fig. 5.12: recompute-offload-keep (ROK) curves of BERT stacks, and the ssd-plan check.

For each BERT configuration, every strategy and micro-batch is run for a few
training steps (bf16, SGD) and placed on the ROK plane (activation peak,
model TFLOP/s). The bar (issue 6): at the same micro-batch, offload points reach
>= 95% of keep's throughput at a lower activation peak than recompute's. The
ssd-plan estimate of activation bytes is compared with what the offloader
wrote (bar: within 10%).

Run:  PYTHONPATH=src:. python benchmarks/rok.py [--quick]
Writes benchmarks/results/rok.json and rok.png (one panel per configuration).
"""
from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, write_result
from datapath.analysis.presets import TransformerConfig, build_workload, get_preset
from datapath.analysis.rok import RokPoint, RokResult, sweep
from datapath.analysis.ssd_plan import activation_breakdown

OFFLOAD_PREFIX = ("offload-", "recompute+offload-")


def _bar_rows(name: str, res: RokResult) -> list[dict[str, Any]]:
    """Each offload point against keep (throughput) and recompute (activation peak) at its micro-batch."""
    rows = []
    for p in res.points:
        if not p.strategy.startswith(OFFLOAD_PREFIX) or not p.ok:
            continue
        keep, rec = res.point("keep", p.micro_batch), res.point("recompute", p.micro_batch)
        tput = p.throughput_flops / keep.throughput_flops if keep and keep.ok else None
        mem = p.activation_peak_bytes / rec.activation_peak_bytes if rec and rec.ok else None
        rows.append({
            "config": name, "strategy": p.strategy, "mb": p.micro_batch,
            "act_peak_GB": p.activation_peak_bytes / 1e9,
            "TFLOP/s": p.throughput_flops / 1e12,
            "tput_vs_keep": tput,
            "peak_vs_recompute": mem,
            "offloaded_GB": None if p.bytes_offloaded_per_step is None else p.bytes_offloaded_per_step / 1e9,
            "bar_met": bool(tput is not None and mem is not None and tput >= 0.95 and mem < 1.0),
        })
    return rows


def _estimate_rows(name: str, res: RokResult, check: RokResult, cfg: Any, dtype: torch.dtype,
                   device: str) -> list[dict[str, Any]]:
    """ssd-plan's activation bytes per step against what the offloader took and wrote per step.

    ``check``: offload-host with ``min_bytes=0, keep_last_modules=0`` and ``max_inflight_bytes``
    512 MiB (the forward waits for stores rather than running ahead of them), so every saved
    activation is handed to the offloader and almost all of it is written: `activation_breakdown`'s total is compared
    with the bytes it queued for writing (``bytes_queued``) and with the bytes it
    actually wrote (``bytes_offloaded``; stores cancelled because the tensor was
    needed first are not written). The sweep's policy-"all" points (defaults: the
    last layer and storages under 1 MiB kept) are listed for information.
    """
    rows = []
    for kind, result in (("check", check), ("sweep", res)):
        for p in result.points:
            if p.strategy not in ("offload-host", "offload-ssd") or not p.ok or p.bytes_offloaded_per_step is None:
                continue
            per = p.offload_stats_per_step or {}
            est = activation_breakdown(cfg.shape(p.micro_batch, dtype, device))["total"]
            queued = per.get("bytes_queued")
            rows.append({
                "config": name, "run": kind, "strategy": p.strategy, "mb": p.micro_batch,
                "estimate_GB": est / 1e9,
                "queued_GB": None if queued is None else queued / 1e9,
                "written_GB": p.bytes_offloaded_per_step / 1e9,
                "forwarded_GB": per.get("bytes_forwarded", 0.0) / 1e9,
                "queued_vs_est": None if queued is None else queued / est,
                "written_vs_est": p.bytes_offloaded_per_step / est,
                "queued_within_10pct": (bool(abs(queued / est - 1) <= 0.10)
                                        if kind == "check" and queued is not None else None),
                "written_within_10pct": bool(abs(p.bytes_offloaded_per_step / est - 1) <= 0.10)
                if kind == "check" else None,
            })
    return rows


def _summary(bar_rows: list[dict[str, Any]], est_rows: list[dict[str, Any]]) -> dict[str, Any]:
    checks = [r for r in est_rows if r["run"] == "check"]
    by_strategy: dict[str, dict[str, int]] = {}
    for r in bar_rows:
        d = by_strategy.setdefault(r["strategy"], {"points": 0, "tput_within_5pct": 0, "peak_below_recompute": 0,
                                                   "both": 0})
        d["points"] += 1
        d["tput_within_5pct"] += bool(r["tput_vs_keep"] is not None and r["tput_vs_keep"] >= 0.95)
        d["peak_below_recompute"] += bool(r["peak_vs_recompute"] is not None and r["peak_vs_recompute"] < 1.0)
        d["both"] += bool(r["bar_met"])
    return {
        "bar": {"rows": bar_rows, "offload_points": len(bar_rows), "met": sum(r["bar_met"] for r in bar_rows),
                "by_strategy": by_strategy},
        "estimate_check": {
            "rows": est_rows,
            "queued_within_10pct": bool(checks) and all(r["queued_within_10pct"] for r in checks),
            "written_within_10pct": bool(checks) and all(r["written_within_10pct"] for r in checks),
        },
    }


def _load(doc_configs: dict[str, Any]) -> dict[str, RokResult]:
    out = {}
    fields = set(RokPoint.__dataclass_fields__)
    for n, d in doc_configs.items():
        pts = [RokPoint(**{k: v for k, v in p.items() if k in fields}) for p in d["points"]]
        out[n] = RokResult(d["workload"], d["device"], d["dtype"], pts, d.get("settings", {}))
    return out


def _reanalyze(path: str, budget: float | None) -> None:
    """Recompute the bar and estimate tables and the plot from a rok.json (no GPU needed)."""
    import json

    with open(path) as f:
        doc = json.load(f)
    results, checks = _load(doc["configs"]), _load(doc["estimate_check_runs"])
    dtype = getattr(torch, next(iter(results.values())).dtype)
    device = "cuda" if doc["machine"].get("gpu") else "cpu"
    bar_rows: list[dict[str, Any]] = []
    est_rows: list[dict[str, Any]] = []
    for n, r in results.items():
        bar_rows += _bar_rows(n, r)
        wl = r.workload
        cfg = TransformerConfig(**{k: wl[k] for k in TransformerConfig.__dataclass_fields__ if k in wl})
        est_rows += _estimate_rows(n, r, checks[n], cfg, dtype, device)
    doc.update(_summary(bar_rows, est_rows))
    doc["reanalyzed"] = "bar and estimate tables recomputed from the measured points by benchmarks/rok.py --reanalyze"
    if budget is None:
        budget = doc["configs"][next(iter(results))].get("budget_bytes")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "rok.json").write_text(json.dumps(doc, indent=1, default=str))
    _plot(results, budget, doc["machine"]["gpu"]["name"] if doc["machine"].get("gpu") else "cpu")
    _report(results, budget, bar_rows, est_rows)


def _report(results: dict[str, RokResult], budget: float | None, bar_rows: list[dict[str, Any]],
            est_rows: list[dict[str, Any]]) -> None:
    for n, r in results.items():
        print(f"\n{n}")
        print(r.format_table(budget))
    if est_rows:
        print("\nssd-plan activation estimate vs bytes the offloader queued / wrote (per step)")
        print_table(est_rows)
    print("\nbar: offload >= 0.95 x keep throughput and < recompute activation peak, same micro-batch")
    print_table(bar_rows)


def _plot(results: dict[str, RokResult], budget: float | None, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, (n, r), tag in zip(axes[0], results.items(), "abcdefgh"):
        r.plot_on(ax, budget, title=f"({tag}) {n}, {label}")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "rok.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models, < 1 minute")
    ap.add_argument("--configs", help="comma-separated presets (default: bert-h16384-l3,bert-h20480-l3)")
    ap.add_argument("--micro-batches", default=None, help="default 1,2,4,8 (quick: 1,2,4)")
    ap.add_argument("--strategies", default="keep,recompute,offload-host,offload-host-adaptive,"
                                            "recompute+offload-host")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget-gb", type=float, default=None, help="activation budget for the verdict")
    ap.add_argument("--ssd-path", default=None, help="directory for the ssd target (default: a temp dir)")
    ap.add_argument("--reanalyze", metavar="ROK_JSON", help="recompute tables and plot from a result file")
    args = ap.parse_args()
    if args.reanalyze:
        _reanalyze(args.reanalyze, None if args.budget_gb is None else args.budget_gb * 1e9)
        return

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.configs:
        configs = args.configs.split(",")
    elif args.quick:
        configs = ["bert-small", "bert:h=2048,l=3,s=512"] if cuda else ["bert-tiny", "bert:h=128,l=3,s=64,v=1024"]
    else:
        configs = ["bert-h16384-l3", "bert-h20480-l3"]
    mbs = [int(x) for x in (args.micro_batches or ("1,2,4" if args.quick else "1,2,4,8")).split(",")]
    strategies = args.strategies.split(",")

    results: dict[str, RokResult] = {}
    checks: dict[str, RokResult] = {}
    bar_rows: list[dict[str, Any]] = []
    est_rows: list[dict[str, Any]] = []
    budget = None if args.budget_gb is None else args.budget_gb * 1e9
    t_start = time.perf_counter()

    def save() -> None:  # after every configuration, so a run cut short still leaves its results
        payload = {
            "configs": {n: r.to_dict(budget) for n, r in results.items()},
            "estimate_check_runs": {n: r.to_dict() for n, r in checks.items()},
            **_summary(bar_rows, est_rows),
            "wall_s": time.perf_counter() - t_start,
        }
        write_result("rok", payload)
        _plot(results, budget, torch.cuda.get_device_name() if cuda else "cpu")

    for spec in configs:
        cfg = get_preset(spec)
        name = cfg.label
        t0 = time.perf_counter()
        workload = build_workload(cfg, device, dtype)
        res = sweep(workload, strategies, mbs, steps=args.steps, warmup=args.warmup, device=device,
                    dtype=dtype, ssd_path=args.ssd_path,
                    progress=lambda p: print(f"  {name} {p.strategy} mb={p.micro_batch}: {p.status}"
                                             + (f" {p.throughput_flops / 1e12:.1f} TFLOP/s" if p.ok else "")
                                             + (f" peak {p.activation_peak_bytes / 1e9:.2f} GB" if p.ok else ""),
                                             flush=True))
        check_mb = mbs[len(mbs) // 2]
        check = sweep(workload, ["offload-host"], [check_mb], steps=args.steps, warmup=1, device=device,
                      dtype=dtype, offload_options={"min_bytes": 0, "keep_last_modules": 0,
                                                      "max_inflight_bytes": 512 << 20})
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        results[name], checks[name] = res, check
        bar_rows += _bar_rows(name, res)
        est_rows += _estimate_rows(name, res, check, cfg, dtype, device)
        save()
        del workload
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    print(f"wrote {RESULTS_DIR / 'rok.json'} and {RESULTS_DIR / 'rok.png'}")

    _report(results, budget, bar_rows, est_rows)


if __name__ == "__main__":
    main()
