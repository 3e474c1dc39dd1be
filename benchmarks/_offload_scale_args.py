"""B6's command line: the methods, the ladder of lengths, and every option of `benchmarks/offload_scale.py`."""
from __future__ import annotations

import argparse

METHODS = ["checkpoint", "keep", "datapath-budget", "selective_checkpoint", "checkpoint_offload", "datapath-all",
           "save_on_cpu", "torchtune", "compile_budget", "compiler_offload", "checkpoint_compiled"]
LADDER = "2048,4096,8192,16384,32768,49152,65536"


def parse(argv: list[str] | None, description: str = "B6: offloading at 8B scale") -> argparse.Namespace:
    """B6's command line (`benchmarks/offload_scale.py --help`), defaults filled in."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mode", choices=("lora", "fsdp2"), default="lora")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seqs", default=None, help=f"the ladder of sequence lengths [{LADDER}]")
    ap.add_argument("--timed", default=None, help="lengths timed with --warmup/--steps (the settings) [16384,32768]")
    ap.add_argument("--check-seq", type=int, default=None, help="length of the gradient check, added to the ladder "
                                                                 "[2048; 0: no check]")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget-warmup", type=int, default=6, help="extra warm-up steps of datapath-budget (it "
                                                                   "profiles, plans and tries plans)")
    ap.add_argument("--datapath-budgets", default="checkpoint,device",
                    help="datapath-budget's budgets, in this order: checkpoint (checkpointing's peak at the length), "
                         "device (the GPU's memory less a margin, at the longest timed lengths)")
    ap.add_argument("--datapath-pace", type=int, default=None,
                    help="units datapath's methods let the CPU run ahead of the GPU (offload(pace=N); the "
                         "library's default: 1); recorded as `pace`")
    ap.add_argument("--datapath-compile", action="store_true",
                    help="datapath's methods with compile=True (each block compiled; recorded as `compile`)")
    ap.add_argument("--datapath-partition", action="store_true",
                    help="with --datapath-compile: memory_budget may recompute compiled blocks by their region's "
                         "partitioner (offload(partition_compiled=True); gradients to rounding, not bit for bit)")
    ap.add_argument("--datapath-attention-saved", action="store_true",
                    help="datapath-all recomputes every block keeping its attention outputs (set_recompute(..., "
                         "attention_saved=...); with --datapath-compile, inside each compiled region), everything "
                         "saved offloaded; recorded as `attention_saved_blocks`")
    ap.add_argument("--log-plans", action="store_true", help="print datapath's planning log (INFO)")
    ap.add_argument("--trace", action="store_true", help="after the timed steps, one more under torch.profiler: "
                                                         "GPU compute / NCCL / copy time, NCCL not hidden, CPU "
                                                         "waits on the GPU (trace_per_rank in each record)")
    ap.add_argument("--trace-dir", default=None, help="with --trace: write each traced step's Chrome trace there "
                                                        "(<name>_<method>_<seq>_rank<r>.json)")
    ap.add_argument("--compile-budgets", default="0.5")
    ap.add_argument("--compile-cost", type=float, default=90.0, help="seconds a compiled method is expected to cost")
    ap.add_argument("--time-budget", type=float, default=360.0, help="seconds; later work is skipped and recorded")
    ap.add_argument("--name", default="offload_scale")
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU (fsdp2: 2 gloo processes)")
    ap.add_argument("--finish", metavar="JSON", help="a run's JSON cut short (partial): add a record for each method "
                                                       "it never reached (--reason says why) and write the result "
                                                       "and the plot to benchmarks/results/")
    ap.add_argument("--reason", default="not reached: the run ended first")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs = args.seqs or "32,64"
        args.timed = args.timed or "32"
        args.check_seq = args.check_seq or 32
        args.budget_warmup = min(args.budget_warmup, 4)
    if args.datapath_attention_saved and "datapath-budget" in args.methods.split(","):
        ap.error("--datapath-attention-saved is for datapath-all: memory_budget's plans choose what each block "
                 "recomputes themselves; run datapath-budget in another call")
    bad = set(args.datapath_budgets.split(",")) - {"checkpoint", "device", ""}
    if bad:
        ap.error(f"--datapath-budgets takes checkpoint and/or device, not {sorted(bad)}")
    args.seqs = args.seqs or LADDER
    args.timed = args.timed or "16384,32768"
    args.check_seq = 2048 if args.check_seq is None else args.check_seq
    if args.check_seq > 0:  # the gradient check runs in the ladder: its length is always one of the lengths
        args.seqs = ",".join(str(n) for n in sorted({int(n) for n in args.seqs.split(",") if n} | {args.check_seq}))
    return args
