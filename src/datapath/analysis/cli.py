"""``datapath rok`` and ``datapath ssd-plan``: the ROK curve and the SSD plan from the command line."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("datapath.analysis.cli")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _add_model_args(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    from datapath.analysis.presets import PRESETS

    g = p.add_argument_group("model")
    g.add_argument("--preset", default=default_preset,
                   help=f"model preset ({', '.join(PRESETS)}) or a spec like 'bert:h=1024,l=4,s=512'")
    g.add_argument("--family", choices=("gpt", "bert", "t5"), help="override the preset's family")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--layers", type=int, help="transformer layers (T5: encoder + decoder)")
    g.add_argument("--seq", type=int, help="sequence length")
    g.add_argument("--heads", type=int, help="attention heads (default hidden/128)")
    g.add_argument("--vocab", type=int, help="vocabulary size")


def _config(args: argparse.Namespace) -> Any:
    from datapath.analysis.presets import get_preset

    cfg = get_preset(args.preset, hidden=args.hidden, layers=args.layers, seq=args.seq,
                     heads=args.heads, vocab=args.vocab)
    if args.family and args.family != cfg.family:
        cfg = cfg.replace(family=args.family, name="")
    return cfg


def _check_dir_arg(flag: str, path: str) -> None:
    """``path`` is a directory, or can be made one (no regular file on the way)."""
    from datapath.analysis.rok import RokError

    p = Path(path).expanduser()
    for q in [p, *p.parents]:
        if q.exists():
            if not q.is_dir():
                raise RokError(f"{flag} {path}: {q} is not a directory")
            break


def _dump(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {path}")


# --------------------------------------------------------------------------- rok

def _cmd_rok(args: argparse.Namespace) -> int:
    import torch

    from datapath._runtime import machine_info
    from datapath.analysis.rok import RokError, load_model_factory, sweep
    from datapath.analysis.ssd_plan import PlanError

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    offload_options: dict[str, Any] = {}
    if args.min_bytes is not None:
        offload_options["min_bytes"] = args.min_bytes
    if args.keep_last_modules is not None:
        offload_options["keep_last_modules"] = args.keep_last_modules

    def progress(pt: Any) -> None:
        peak = "-" if pt.activation_peak_bytes is None else f"{pt.activation_peak_bytes / 1e9:.4g} GB"
        tput = "-" if pt.throughput_flops is None else f"{pt.throughput_flops / 1e12:.4g} TFLOP/s"
        log.info("%s mb=%d: %s, activation peak %s, %s", pt.strategy, pt.micro_batch, pt.status, peak, tput)

    if args.png:  # before the sweep, not after it: a missing extra is one line and no lost run
        from datapath._runtime.optional import require  # noqa: PLC0415

        require("matplotlib", extra="plot", purpose="--png")
    try:
        if args.ssd_path:
            _check_dir_arg("--ssd-path", args.ssd_path)
        model: Any = load_model_factory(args.model_factory) if args.model_factory else _config(args)
        result = sweep(model, strategies, args.micro_batches, steps=args.steps, warmup=args.warmup,
                       device=args.device, dtype=dtype, ssd_path=args.ssd_path,
                       offload_options=offload_options, progress=progress)
    except (RokError, PlanError) as exc:
        print(f"error: {exc}")
        return 2
    budget = None if args.budget_gb is None else args.budget_gb * 1e9
    failed = [p for p in result.points if not p.ok]
    if result.points and len(failed) == len(result.points):
        print(f"error: every point failed; the first: {failed[0].strategy} at micro-batch "
              f"{failed[0].micro_batch}: {failed[0].status}: {failed[0].error}")
        return 1
    doc = result.to_dict(budget)
    doc["machine"] = machine_info()
    note = _rok_too_small(result.points)
    if note:
        doc["note"] = note
    _dump(args.json, doc)
    if args.png:
        print(f"wrote {result.plot(args.png, budget)}")
    print(result.format_table(budget))
    if note:
        print(f"note: {note}")
    return 0


TOO_SMALL_BYTES = 64 << 20  # activations below this per step: timings are launch overhead, not data movement


def _rok_too_small(points: list[Any]) -> str | None:
    """One line saying why the figures of a preset this small mean nothing (None: they mean something)."""
    ok = [p for p in points if p.ok]
    peak = max((p.activation_peak_bytes or 0 for p in ok), default=0)
    offloads = [p for p in ok if "offload" in p.strategy]
    nothing_moved = bool(offloads) and all(not p.bytes_offloaded_per_step for p in offloads)
    if peak >= TOO_SMALL_BYTES and not nothing_moved:
        return None
    why = [f"the largest activation peak is {peak / 2**20:.3g} MiB (under {TOO_SMALL_BYTES >> 20} MiB)"]
    if nothing_moved:
        why.append("the offload strategies moved 0 bytes (storages under --min-bytes stay)")
    return ("this preset is too small to measure: " + "; ".join(why) + ", so step times are launch overhead and "
            "the curve says nothing about offloading; use a larger preset or --micro-batches")


# --------------------------------------------------------------------------- ssd-plan

def _cmd_ssd_plan(args: argparse.Namespace) -> int:
    from datapath.analysis.ssd_plan import (
        DRIVES, GPUS, Drive, GpuSpec, Parallelism, PlanError, TransformerShape, paper_table_5_4, plan,
        sweep_plan,
    )

    if args.paper_table:
        rows = paper_table_5_4(args.efficiency)
        cols = ["config", "paper_estimate_gb", "ours_gb", "err_vs_estimate", "paper_offloaded_gb",
                "err_vs_offloaded", "paper_bandwidth_gbps", "ours_bandwidth_gbps", "err_bandwidth"]
        print("SSDTrain Table 5.4 (BERT, TP=2, A100, batch 16, seq 1024) against this model")
        print(_rows_text([{c: r[c] for c in cols} for r in rows]))
        _dump(args.json, {"paper_table_5_4": rows, "efficiency": args.efficiency})
        return 0
    try:
        cfg = _config(args)
        shape = TransformerShape(
            layers=cfg.layers, hidden=cfg.hidden, heads=cfg.n_heads, seq=cfg.seq, micro_batch=args.micro_batch,
            family=cfg.family, ffn_hidden=cfg.ffn_mult * cfg.hidden, vocab=cfg.n_vocab if args.include_head else 0,
            dtype_bytes=args.dtype_bytes, dropout=not args.no_dropout, flash_attention=not args.no_flash,
            recompute_elementwise=args.recompute_elementwise,
        )
        par = Parallelism(tp=args.tp, pp=args.pp, sequence_parallel=args.sequence_parallel,
                          microbatches=args.microbatches)
        if args.gpu_tflops is not None:
            gpu = GpuSpec(args.gpu_tflops, args.efficiency, "custom")
        else:
            if args.gpu not in GPUS:
                raise PlanError(f"unknown --gpu {args.gpu!r}; known: {', '.join(GPUS)} (or give --gpu-tflops)")
            gpu = GpuSpec(GPUS[args.gpu], args.efficiency, args.gpu)
        if args.capacity_tb is not None:
            drive = Drive(args.capacity_tb, dwpd=args.dwpd, pbw=args.pbw, warranty_years=args.warranty_years)
        else:
            if args.drive not in DRIVES:
                raise PlanError(f"unknown --drive {args.drive!r}; known: {', '.join(DRIVES)} (or give --capacity-tb)")
            drive = DRIVES[args.drive]
        kw: dict[str, Any] = dict(par=par, gpu=gpu, drive=drive, drives_per_gpu=args.drives,
                                  waf_rating=args.waf_rating, waf_workload=args.waf,
                                  include_head=args.include_head, step_time_s=args.step_time)
        values: list[float] = []
        if args.sweep:  # checked before anything is printed
            param, _, vals = args.sweep.partition("=")
            try:
                values = [float(v) for v in vals.split(",") if v.strip()]
            except ValueError:
                raise PlanError(f"--sweep {args.sweep}: the values must be numbers; write --sweep PARAM=V1,V2,... "
                                f"(e.g. --sweep hidden=1024,2048,4096)") from None
            if not param or not values:
                raise PlanError(f"--sweep wants PARAM=V1,V2,... (e.g. hidden=1024,2048), got {args.sweep!r}")
            try:
                plans = sweep_plan(shape, param, values, **kw)
            except PlanError as exc:
                raise PlanError(f"--sweep {args.sweep}: {exc}") from None
            if args.png:
                from datapath._runtime.optional import require  # noqa: PLC0415

                require("matplotlib", extra="plot", purpose="--png")
        p = plan(shape, **kw)
        doc: dict[str, Any] = {"plan": p.as_dict()}
        print(f"{cfg.family} h={shape.hidden} layers={shape.layers} heads={shape.heads} seq={shape.seq} "
              f"micro-batch={shape.micro_batch} tp={par.tp} pp={par.pp} micro-batches/step={par.microbatches} "
              f"on {gpu.name} ({gpu.peak_tflops:g} TFLOP/s x {gpu.efficiency:g})")
        print(_rows_text(p.table_rows()))
        note = _plan_too_small(p)
        if note:
            doc["note"] = note
            print(f"note: {note}")
        if args.sweep:
            rows = [{param: int(v) if float(v).is_integer() else v,
                     "act_GB": q.activation_bytes_per_step / 1e9, "step_s": q.step_time_s,
                     "write_GB/s": q.write_bandwidth_gbps, "lifespan_years": q.lifespan_years}
                    for v, q in zip(values, plans)]
            print(f"\nsweep over {param}")
            print(_rows_text(rows))
            doc["sweep"] = {"param": param, "plans": [q.as_dict() for q in plans]}
            if args.png:
                _plot_sweep(args.png, param, values, plans)
                print(f"wrote {args.png}")
    except PlanError as exc:
        print(f"error: {exc}")
        return 2
    _dump(args.json, doc)
    return 0


def _plan_too_small(p: Any) -> str | None:
    """One line saying why the plan of a shape this small means nothing (None: it means something)."""
    if p.activation_bytes_per_step >= TOO_SMALL_BYTES and p.step_time_s >= 1e-3:
        return None
    return (f"this shape is too small for these figures to mean anything: {p.activation_bytes_per_step / 2**20:.3g} "
            f"MiB of activations in a {p.step_time_s:.3g} s step, so the bandwidth and lifespan are extrapolated "
            f"from a step no real run has; use a larger preset or give --step-time")


def _plot_sweep(path: str, param: str, values: list[float], plans: list[Any]) -> None:
    from datapath._runtime.optional import require  # noqa: PLC0415

    matplotlib = require("matplotlib", extra="plot", purpose="--png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax1 = plt.subplots(figsize=(7, 4.5))
    ax1.plot(values, [q.write_bandwidth_gbps for q in plans], "o-", color="tab:blue")
    ax1.set_xlabel(param)
    ax1.set_ylabel("write bandwidth needed (GB/s)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(values, [q.lifespan_years for q in plans], "s--", color="tab:pink")
    ax2.set_ylabel("projected SSD lifespan (years)", color="tab:pink")
    ax1.grid(alpha=0.3)
    ax1.set_title("SSD plan (SSDTrain §5.3.6 model)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rows_text(rows: list[dict[str, Any]]) -> str:
    from datapath.analysis.rok_result import format_rows

    return format_rows(rows)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``rok`` and ``ssd-plan`` to the ``datapath`` command."""
    from datapath.analysis.ssd_plan import DRIVES, GPUS

    p = subparsers.add_parser(
        "rok", help="ROK curve: activation peak vs model throughput for keep/recompute/offload",
        description="Run a model for a few steps under each activation strategy and micro-batch size; "
                    "write JSON and a PNG of the recompute-offload-keep curve; name the best under a budget.")
    _add_model_args(p, "bert-tiny")
    p.add_argument("--model-factory", metavar="MODULE:FUNCTION",
                   help="your model: FUNCTION(device, dtype) returns a datapath.analysis.Workload "
                        "or (model, make_batch); overrides --preset")
    p.add_argument("--strategies", default="keep,recompute,offload-host,offload-ssd-adaptive,recompute+offload-host",
                   help="comma-separated: keep, recompute, offload-host, offload-host-adaptive, offload-ssd, "
                        "offload-ssd-adaptive, offload-tiered, recompute+offload-host, recompute+offload-ssd, "
                        "save-on-cpu")
    p.add_argument("--micro-batches", type=_int_list, default=[1, 2, 4], help="e.g. 1,2,4,8")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point (adaptive: at least 2)")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--ssd-path", help="directory for the ssd/tiered targets (default: a temporary one)")
    p.add_argument("--min-bytes", type=int, help="offloader: keep tensors smaller than this")
    p.add_argument("--keep-last-modules", type=int, help="offloader: modules at the end kept on the GPU")
    p.add_argument("--budget-gb", type=float, help="activation memory budget (GB = 1e9 B) for the verdict")
    p.add_argument("--json", help="write every point here")
    p.add_argument("--png", help="write the ROK curve here")
    p.set_defaults(func=_cmd_rok)

    q = subparsers.add_parser(
        "ssd-plan", help="activation bytes, write bandwidth and SSD lifespan for offloading (SSDTrain §5.3.6)",
        description="Per-GPU activation bytes per step, forward/step time, the write bandwidth needed to hide "
                    "offloading, and the projected lifespan of the drives. Bytes are decimal (GB = 1e9 B).")
    _add_model_args(q, "bert-h12288-l3")
    q.add_argument("--micro-batch", type=int, default=1)
    q.add_argument("--microbatches", type=int, default=1, help="micro-batches per step per GPU")
    q.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    q.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    q.add_argument("--sequence-parallel", action="store_true")
    q.add_argument("--dtype-bytes", type=int, default=2)
    q.add_argument("--no-dropout", action="store_true")
    q.add_argument("--no-flash", action="store_true", help="attention scores are materialised (no FlashAttention)")
    q.add_argument("--recompute-elementwise", action="store_true",
                   help="count what datapath's offloader writes by default: GELU outputs are recomputed in backward "
                        "from their stored inputs, not written (SSDTrain's count writes them)")
    q.add_argument("--include-head", action="store_true",
                   help="count the embedding and LM head too (default: transformer layers, as SSDTrain)")
    q.add_argument("--gpu", default="a100", help=f"GPU preset: {', '.join(GPUS)}")
    q.add_argument("--gpu-tflops", type=float, help="peak dense 16-bit TFLOP/s (overrides --gpu)")
    q.add_argument("--efficiency", type=float, default=0.44, help="fraction of peak achieved (default 0.44)")
    q.add_argument("--step-time", type=float, help="measured step time in s (replaces the modelled one)")
    q.add_argument("--drive", default="solidigm-d7-p5620-12.8tb", help=f"drive preset: {', '.join(DRIVES)}")
    q.add_argument("--capacity-tb", type=float, help="custom drive capacity (TB); with --dwpd or --pbw")
    q.add_argument("--dwpd", type=float, help="custom drive writes per day")
    q.add_argument("--pbw", type=float, help="custom drive rated PB written")
    q.add_argument("--warranty-years", type=float, default=5.0)
    q.add_argument("--drives", type=int, default=4, help="drives per GPU (default 4)")
    q.add_argument("--waf-rating", type=float, default=2.5, help="write amplification of the endurance rating")
    q.add_argument("--waf", type=float, default=1.0, help="write amplification of activation writes")
    q.add_argument("--sweep", metavar="PARAM=V1,V2,...", help="also plan for each value (hidden, layers, "
                   "micro_batch, seq, tp, pp, microbatches, efficiency, peak_tflops)")
    q.add_argument("--paper-table", action="store_true", help="reproduce SSDTrain Table 5.4 and exit")
    q.add_argument("--json", help="write the plan here")
    q.add_argument("--png", help="plot the sweep here")
    q.set_defaults(func=_cmd_ssd_plan)
