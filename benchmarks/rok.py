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
import os
import time
from typing import Any

import torch
import torch.utils.backend_registration as _backend_registration

# Importing datapath registers the "unified" device by renaming PyTorch's PrivateUse1 backend; from
# then on at::getAccelerator() names it instead of CUDA and every CUDA backward fails inside PyTorch
# (pytorch#161129). This benchmark trains on CUDA and uses no unified tensor, so unless
# DATAPATH_ROK_KEEP_PRIVATEUSE1=1 it skips the rename (the unified device is unusable in this process).
WORKAROUNDS: list[str] = []
if os.environ.get("DATAPATH_ROK_KEEP_PRIVATEUSE1") != "1" and torch.cuda.is_available():
    _backend_registration._setup_privateuseone_for_python_backend = lambda *a, **k: None  # type: ignore[assignment]
    WORKAROUNDS.append("PrivateUse1 rename for the 'unified' device skipped (pytorch#161129 breaks CUDA backward)")

from benchmarks._common import RESULTS_DIR, print_table, write_result  # noqa: E402
from datapath._runtime import device_label  # noqa: E402
from datapath.offload.presets import build_workload, get_preset  # noqa: E402
from datapath.offload.rok import RokResult, sweep  # noqa: E402
from datapath.offload.ssd_plan import activation_breakdown  # noqa: E402

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
    """ssd-plan's activation bytes per step against what the offloader wrote per step.

    ``check``: offload-host with ``min_bytes=0, keep_last_modules=0``, so the offloader
    is asked to write every saved activation: compared with `activation_breakdown`'s
    total (the bar: within 10%). The sweep's policy-"all" points (defaults: the last
    layer and storages under 1 MiB kept) are listed with the share of the estimate they
    wrote, for information.
    """
    rows = []
    for kind, result in (("check", check), ("sweep", res)):
        for p in result.points:
            if p.strategy not in ("offload-host", "offload-ssd") or not p.ok or p.bytes_offloaded_per_step is None:
                continue
            est = activation_breakdown(cfg.shape(p.micro_batch, dtype, device))["total"]
            ratio = p.bytes_offloaded_per_step / est
            rows.append({
                "config": name, "run": kind, "strategy": p.strategy, "mb": p.micro_batch,
                "estimate_GB": est / 1e9,
                "offloaded_GB": p.bytes_offloaded_per_step / 1e9,
                "ratio": ratio,
                "within_10pct": bool(abs(ratio - 1) <= 0.10) if kind == "check" else None,
            })
    return rows


def _plot(results: dict[str, RokResult], budget: float | None, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, (n, r), tag in zip(axes[0], results.items(), "abcdefgh"):
        r.plot_on(ax, budget, title=f"({tag}) {n}, {device_label() if device == 'cuda' else 'cpu'}")
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
    args = ap.parse_args()

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
            "bar": {"rows": bar_rows, "offload_points": len(bar_rows), "met": sum(r["bar_met"] for r in bar_rows)},
            "estimate_check": {
                "rows": est_rows,
                "bar_within_10pct": bool([r for r in est_rows if r["run"] == "check"])
                and all(r["within_10pct"] for r in est_rows if r["run"] == "check"),
            },
            "wall_s": time.perf_counter() - t_start,
            "workarounds": WORKAROUNDS,
        }
        write_result("rok", payload)
        _plot(results, budget, device)

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
                      dtype=dtype, offload_options={"min_bytes": 0, "keep_last_modules": 0})
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

    for n, r in results.items():
        print(f"\n{n}")
        print(r.format_table(budget))
    if est_rows:
        print("\nssd-plan activation estimate vs bytes the offloader wrote (per step)")
        print_table(est_rows)
    print("\nbar: offload >= 0.95 x keep throughput and < recompute activation peak, same micro-batch")
    print_table(bar_rows)


if __name__ == "__main__":
    main()
