"""B6: activation offloading at the scale people train -- the Llama-3-8B shape, LoRA on one GPU, FSDP2 on several.

LoRA (``--mode lora``, one GPU): the 8B shape (`benchmarks/_llama8b.py`) frozen in bf16, peft LoRA r=16 on
q/k/v/o/gate/up/down, micro-batch 1, AdamW on the adapters (lr 0: every method starts from the same weights).
Per method a ladder of sequence lengths (``--seqs``), ascending, stopped at the first that does not fit
(``torch.OutOfMemoryError``: a record with ``oom: true``); at the settings' lengths (``--timed``) ``--warmup``
steps then ``--steps`` timed ones, elsewhere one step (the fit test; its time is a single step's).  Methods: keep,
checkpoint (Hugging Face's, each layer, non-reentrant), selective_checkpoint (torchtitan's op-level policy: keep
attention and every second matmul), checkpoint_offload (full checkpointing with its layer inputs in pinned host
memory: Hugging Face's ``offload=True``, torchtune's checkpointing + offloading), save_on_cpu, torchtune (when it
imports), datapath-budget (``offload(model, memory_budget=B)``: B = checkpointing's peak at that length, and B =
the GPU's memory less a margin for the longest length), datapath-all (``offload(model)``), compile_budget
(each layer compiled with ``torch._functorch.config.activation_memory_budget``), compiler_offload (PyTorch's
compiler activation offloading, where this torch has it), checkpoint_compiled (checkpointing with each layer
compiled: torchtitan's compile + activation checkpointing per block).  A method not run gets a record saying why.

FSDP2 (``--mode fsdp2``, under ``torchrun``): ``fully_shard`` per decoder layer and at the root, fp32 parameters
with bf16 compute (``MixedPrecisionPolicy``), fp32 AdamW state, every parameter trained; the same ladder per rank
(tokens/s per GPU, peak per rank).  ``--quick``: tiny configs on the CPU (gloo), seconds.

Records (``benchmarks/results/offload_scale.json``, written after every method so a run stopped midway keeps what
it measured): {setting, method, budget_gb, tokens_per_s, peak_gb (the largest rank's), peak_gb_per_rank, mfu,
grads_match, seq, device, oom, steps, ...}.  MFU: `model_flops_per_token` (LoRA: 4 N_base + 6 N_lora + causal
attention 6 L S H per token; full: 6 N + attention) times tokens/s over the device's dense bf16 peak.
grads_match: two more steps per method at ``--check-seq`` (2048: keep fits) with deterministic algorithms and SDPA's
math attention (flash attention's backward is not bitwise reproducible); the first's trained parameters' gradients
compared with checkpointing's at that length (the same arithmetic: recomputation reruns the same kernels,
offloading moves bytes): ``grads_match_kind`` "bitwise", else their largest difference relative to the largest
gradient (``grads_rel_diff``; against keep's: ``grads_rel_diff_keep``); ``grads_repeat_bitwise``: the method's two
check steps agree bit for bit.  Peak: ``torch.cuda.max_memory_allocated()`` over a step.

Run: PYTHONPATH=src:. python benchmarks/offload_scale.py [--mode lora] [--time-budget 360]
     torchrun --nproc-per-node 2 benchmarks/offload_scale.py --mode fsdp2 --seqs 8192,16384
     python benchmarks/offload_scale.py --quick [--mode fsdp2]   (CPU; fsdp2 starts 2 gloo processes itself)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
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

from benchmarks._common import write_result  # noqa: E402
from benchmarks._llama8b import (  # noqa: E402
    CausalLMLoss, add_lora, build_llama, causal_lm, llama_config, model_flops_per_token, peak_flops,
    set_checkpointing,
)
from benchmarks._offload_scale_args import parse  # noqa: E402
from benchmarks._offload_scale_report import bars, cache_record, finish, plan_brief, rel_diff  # noqa: E402
from benchmarks._offload_scale_schedule import run_schedule  # noqa: E402
from benchmarks._offload_workloads import torchtune_offload  # noqa: E402
from benchmarks._step_trace import traced_step  # noqa: E402
from datapath.offload import offload, offload_rank, set_recompute  # noqa: E402


class Bench:
    """One process's model, optimizer, records and clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.dist = args.mode == "fsdp2"
        self.rank, self.world = 0, 1
        if self.dist:
            import torch.distributed as dist  # noqa: PLC0415

            backend = "gloo" if args.quick else "nccl"
            dist.init_process_group(backend)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = torch.cuda.is_available() and not args.quick
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device("cuda") if cuda else torch.device("cpu")
        self.dev_name = torch.cuda.get_device_name() if cuda else "cpu"
        self.peak_flops = peak_flops(self.dev_name)
        seqs = [int(s) for s in args.seqs.split(",")]
        self.cfg = llama_config(args.quick, max(seqs))
        self.records: list[dict[str, Any]] = []
        self.attention_saved_blocks = 0  # datapath-all's blocks recomputed keeping their attention outputs
        self.ref: dict[str, dict[int, list[torch.Tensor]]] = {}  # checkpoint/keep -> seq -> gradients
        self.ckpt_peak: dict[int, float] = {}
        self.stopped: set[tuple[Any, ...]] = set()  # (method, budget kind, compile budget) whose ladder ended
        self.tt_cls, self.tt_why = torchtune_offload()
        self.build()

    # ---------------------------------------------------------------- model
    def build(self) -> None:
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.dist:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            holder: dict[str, nn.Module] = {}

            def shard(lm: nn.Module) -> None:
                for layer in lm.model.layers:
                    fully_shard(layer, mp_policy=mp)
                holder["root"] = fully_shard(CausalLMLoss(lm), mp_policy=mp)

            lm = build_llama(self.cfg, self.device, torch.float32, shard=shard)
            self.model = holder["root"]
            self.lm = lm
        else:
            self.lm = add_lora(build_llama(self.cfg, self.device, dtype))
            self.model = CausalLMLoss(causal_lm(self.lm))
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in self.trainable)  # a DTensor's numel is the global one
        # lr 0: every method sees the same weights; AdamW's fp32 state is still built and stepped.  Fused on the
        # GPU: the multi-tensor (foreach) step makes a temporary the size of the parameters (16 GB a rank for the
        # 8B model's fp32 shards under FSDP2), which would set the peak of every method alike
        self.opt = torch.optim.AdamW(self.trainable, lr=0.0, fused=self.device.type == "cuda")

    def setting(self, seq: int) -> str:
        return f"{'fsdp2' if self.dist else 'lora'}-8b-{seq // 1024}k" if not self.args.quick else \
            f"{'fsdp2' if self.dist else 'lora'}-tiny-{seq}"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> float:
        """Seconds of the run so far, the same on every rank (the most of any): ranks that decided apart
        whether to run a method would wait for each other's collectives for ever."""
        return max(self.gather(self.elapsed()))

    # ---------------------------------------------------------------- records
    def rec(self, method: str, seq: int, budget: float | None = None, **kw: Any) -> dict[str, Any]:
        r = {"setting": self.setting(seq), "method": method, "budget_gb": None if budget is None else budget / 1e9,
             "tokens_per_s": None, "peak_gb": None, "peak_gb_per_rank": None, "mfu": None, "grads_match": None,
             "seq": seq, "device": self.dev_name, "oom": False, **kw}
        self.records.append(r)
        if self.rank == 0:
            self.save(partial=True)
            print(f"  {r['setting']} {method}{'' if budget is None else f' budget {budget / 1e9:.1f} GB'}: "
                  f"{r.get('status', 'ok')}{' OOM' if r['oom'] else ''} tokens/s {r['tokens_per_s'] or 0:.0f} "
                  f"peak {r['peak_gb'] or 0:.2f} GB mfu {r['mfu'] or 0:.3f} grads {r['grads_match']} "
                  f"[{self.elapsed():.0f} s]", flush=True)
        return r

    def save(self, partial: bool) -> None:
        write_result(self.args.name, {
            "records": self.records, "partial": partial, "mode": self.args.mode, "world_size": self.world,
            "peak_flops": self.peak_flops, "torch": torch.__version__,
            "mfu_formula": model_flops_per_token.__doc__.split("\n\n")[1].replace("\n", " ").strip(),
            "loss": "chunked linear cross-entropy (4096 positions a chunk, gradients formed in the forward), "
                    "the same for every method",
            "peak": "torch.cuda.max_memory_allocated() over zero_grad + forward + backward + AdamW step",
            "grads_check": "two deterministic steps (torch.use_deterministic_algorithms, SDPA math attention) per "
                           "method at check_seq (grads_repeat_bitwise: the two equal); the first's trained "
                           "parameters' gradients against checkpointing's: bitwise, else the largest difference over "
                           "the largest gradient (grads_rel_diff; against keep's: grads_rel_diff_keep)",
            "check_seq": self.args.check_seq, "torchtune": torchtune_offload()[1], "bars": bars(self.records)})

    # ---------------------------------------------------------------- one method at one length
    @contextlib.contextmanager
    def method(self, method: str, budget: int | None) -> Iterator[Callable[[], Any]]:
        """Set ``method`` up around its steps; yields the per-step context factory."""
        if method in ("checkpoint", "selective_checkpoint", "checkpoint_offload", "checkpoint_compiled"):
            set_checkpointing(self.lm, {"checkpoint": "full", "selective_checkpoint": "selective",
                                        "checkpoint_offload": "offload", "checkpoint_compiled": "full"}[method])
            try:
                yield contextlib.nullcontext
            finally:
                set_checkpointing(self.lm, None)
        elif method == "save_on_cpu":
            yield lambda: torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        elif method == "torchtune":
            yield lambda: self.tt_cls(use_streams=True)
        elif method in ("datapath-all", "datapath-budget"):
            opts: dict[str, Any] = dict(offload_cpu_tensors=True, min_bytes=4096) if self.device.type == "cpu" \
                else {}
            if self.args.datapath_pace is not None:
                opts["pace"] = self.args.datapath_pace
            if self.args.datapath_compile:
                opts["compile"] = True
            if self.args.datapath_partition:
                opts["partition_compiled"] = True
            enter = offload_rank if self.dist else offload  # a rank's share of the host's pinned memory
            with enter(self.model, memory_budget=budget, **opts) as cache:
                self.cache = cache
                if self.args.datapath_attention_saved and method == "datapath-all":
                    blocks = list(causal_lm(self.lm).model.layers)
                    set_recompute(blocks, range(len(blocks)), attention_saved=range(len(blocks)))
                    self.attention_saved_blocks = len(blocks)
                try:
                    yield contextlib.nullcontext
                finally:
                    self.attention_saved_blocks = 0
        else:
            yield contextlib.nullcontext

    def peak_now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 1e9
        return self.meter.lap() / 1e9

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.meter.lap()

    def run(self, method: str, seq: int, budget: int | None, steps: int, warmup: int, check: bool,
            loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
        """Time ``method`` at ``seq``; returns tokens/s, peaks, the gradients of a deterministic step if ``check``."""
        from datapath.offload.memory_meter import CpuMeter  # noqa: PLC0415  (the CPU run's peak, as in B4)

        self.meter = CpuMeter(sum(p.numel() * p.element_size() for p in self.model.parameters()))
        g = torch.Generator(device="cpu").manual_seed(seq)
        ids = torch.randint(0, self.cfg.vocab_size, (1, seq), generator=g).to(self.device)
        fn = loss_fn or self.model
        self.cache = None
        times, peaks = [], []
        grads = None
        cuda = self.device.type == "cuda"
        with self.method(method, budget) as make_ctx:
            def step() -> None:
                self.opt.zero_grad(set_to_none=True)
                with make_ctx():
                    fn(ids).backward()
                self.opt.step()

            retries0 = reserved = 0
            trying = False
            # --trace: datapath-budget's warm-up steps (it profiles, plans, tries plans) each under the profiler
            # too, with the plan each ran: where a plan that lost its trial spent its time
            warm_traces: list[dict[str, Any]] = []
            trace_warm = self.args.trace and method == "datapath-budget"
            for i in range(warmup + steps):
                self.reset_peak()
                if i == warmup:  # the allocator's retries (a full device: cached blocks freed, synchronising)
                    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
                    trying = bool(getattr(getattr(self.cache, "policy", None), "trying", False))
                    if trying:
                        print(f"  {method} at {seq}: its plan trial still runs as the timed steps begin (they time "
                              f"the plans it compares): raise --budget-warmup", flush=True)
                t = time.perf_counter()
                if trace_warm and i < warmup:
                    trace = traced_step(step)
                    # the plan this step ran: the budget switches plans as a step's forward begins
                    warm_traces.append({"plan": plan_brief(getattr(self.cache, "plan", None)), **trace,
                                        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None})
                    continue
                with self.meter if not cuda else contextlib.nullcontext():
                    step()
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t)
                    peaks.append(self.peak_now())
                    if cuda:
                        reserved = max(reserved, torch.cuda.max_memory_reserved())
            retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0) if cuda else 0
            chrome = None
            if self.args.trace_dir:
                Path(self.args.trace_dir).mkdir(parents=True, exist_ok=True)
                chrome = Path(self.args.trace_dir) / f"{self.args.name}_{method}_{seq}_rank{self.rank}.json"
            # one more step, untimed
            traced = traced_step(step, chrome) if cuda and self.args.trace and steps > 1 else None
            if self.dist:  # a step ends when the slowest rank's does: each timed step at its slowest rank's time
                per_rank = self.gather(times)
                times = [max(ts) for ts in zip(*per_rank)]
            repeat_same = None
            if check:  # twice: whether the method's own check step repeats bit for bit says what a mismatch means
                runs = []
                try:
                    torch.use_deterministic_algorithms(True, warn_only=True)
                    for _ in range(2):
                        self.opt.zero_grad(set_to_none=True)
                        with make_ctx(), sdpa_kernel(SDPBackend.MATH):
                            fn(ids).backward()
                        # FSDP2: this rank's shard of each gradient
                        runs.append([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float()
                                     .cpu().clone() if p.grad is not None else torch.zeros(()) for p in self.trainable])
                finally:
                    torch.use_deterministic_algorithms(False)
                grads = runs[0]
                repeat_same = all(torch.equal(x, y) for x, y in zip(*runs))
            extra = cache_record(self.cache, method, warmup + steps + check)
            if self.attention_saved_blocks:
                extra["attention_saved_blocks"] = self.attention_saved_blocks
        self.opt.zero_grad(set_to_none=True)
        step_s = statistics.median(times)
        if cuda:
            extra["alloc_retries_per_rank"] = self.gather(retries)
            extra["reserved_gb_per_rank"] = [r / 1e9 for r in self.gather(reserved)]
            if traced is not None:
                extra["trace_per_rank"] = self.gather(traced)
        if warm_traces:
            extra["warmup_trace_per_rank"] = self.gather(warm_traces)
        return {"step_s": step_s, "steps_s": times, "peak": max(peaks), "grads": grads,
                "grads_repeat_bitwise": repeat_same, "trial_open_at_timing": trying, **extra}

    def attempt(self, method: str, seq: int, budget: int | None, timed: bool, check: bool,
                loss_fn: Any = None, **kw: Any) -> dict[str, Any]:
        """`run`, recording the result: an OOM is a record with ``oom: true``; any other failure a record with
        ``status: error``.  Memory is freed after either."""
        a = self.args
        steps, warmup = (a.steps, a.warmup) if timed else (1, 0)
        if method == "datapath-budget":
            warmup += a.budget_warmup if timed else a.budget_warmup + 1  # it profiles, plans, tries plans
        failure: tuple[str, str] | None = None
        out: dict[str, Any] | None = None
        try:
            out = self.run(method, seq, budget, steps, warmup, check, loss_fn)
        except torch.OutOfMemoryError as exc:
            failure = ("oom", str(exc).split("\n")[0][:300])
        except Exception as exc:  # noqa: BLE001 - one broken method must not lose the others
            if "out of memory" in str(exc).lower():
                failure = ("oom", f"{type(exc).__name__}: {exc}".split("\n")[0][:300])
            else:
                traceback.print_exc()
                failure = ("error", f"{type(exc).__name__}: {exc}"[:400])
        self.opt.zero_grad(set_to_none=True)
        self.cache = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            # pinned host memory a method freed stays in PyTorch's caching host allocator: hand it back, or the
            # methods after it (the host has less RAM than the activations of one 16K step) run out of host memory
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        if out is None:
            assert failure is not None
            return self.rec(method, seq, budget, oom=failure[0] == "oom", status=failure[0], reason=failure[1], **kw)
        tokens = seq * (self.world if self.dist else 1)
        tps = tokens / out["step_s"] / (self.world if self.dist else 1)  # per GPU
        peaks = self.gather_peaks(out["peak"])
        lora = not self.dist
        mfu = tps * model_flops_per_token(self.cfg, seq, self.n_trainable, lora) / self.peak_flops \
            if self.peak_flops else None
        grads = out.pop("grads")
        match = kind = rel = rel_keep = None
        if grads is not None:
            if method in ("checkpoint", "keep"):
                self.ref.setdefault(method, {})[seq] = grads
            ref = self.ref.get("checkpoint", {}).get(seq)
            if ref is not None:
                bitwise = all(torch.equal(x, y) for x, y in zip(grads, ref))
                rel = rel_diff(grads, ref)
                match = bitwise or rel <= 1e-2
                kind = "bitwise" if bitwise else "bf16 ordering" if match else None
            if seq in self.ref.get("keep", {}):
                rel_keep = rel_diff(grads, self.ref["keep"][seq])
        return self.rec(method, seq, budget, tokens_per_s=tps, peak_gb=max(peaks), peak_gb_per_rank=peaks, mfu=mfu,
                        grads_match=match, grads_match_kind=kind, grads_rel_diff=rel, grads_rel_diff_keep=rel_keep,
                        status="ok",
                        steps=len(out["steps_s"]), step_s=out["step_s"], steps_s=out["steps_s"],
                        **{k: v for k, v in out.items() if k not in ("step_s", "steps_s", "peak")}, **kw)

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (``[value]`` without FSDP2)."""
        if not self.dist:
            return [value]
        import torch.distributed as dist  # noqa: PLC0415

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def gather_peaks(self, peak: float) -> list[float]:
        return [float(p) for p in self.gather(peak)]

    def skip(self, method: str, seq: int, reason: str, **kw: Any) -> None:
        self.rec(method, seq, None, status="skipped", reason=reason, **kw)

    def prime(self) -> None:
        """One step at a short length before any method, so that AdamW's state (twice the trainable fp32 shards)
        exists from the first measured step on: built inside a method's first step, it made that step's peak unlike
        the steady steps' (under FSDP2 a first step's forward runs without it, so checkpointing's peak there, used
        as a budget, was one no steady step reaches)."""
        ids = torch.randint(0, self.cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
        self.opt.zero_grad(set_to_none=True)
        self.model(ids.to(self.device)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def main(self) -> None:
        """AdamW's state primed, then the schedule (`benchmarks/_offload_scale_schedule.py`)."""
        self.prime()
        run_schedule(self)



def main(argv: list[str] | None = None) -> int:
    args = parse(argv, __doc__.splitlines()[0])
    if args.log_plans:
        import logging  # noqa: PLC0415

        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("datapath.offload").setLevel(logging.INFO)
    if args.finish:
        return finish(args)
    if args.mode == "fsdp2" and args.quick and "RANK" not in os.environ:
        # the CPU check of the FSDP2 path: two gloo processes through torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               *(argv if argv is not None else sys.argv[1:])]  # --standalone: a free port of its own
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                            os.environ.get("PYTHONPATH", "")])}
        return subprocess.run(cmd, env=env).returncode
    if not args.quick and not torch.cuda.is_available():
        print("B6 needs a CUDA GPU; nothing to do here (--quick checks the script on the CPU).")
        return 0
    torch.manual_seed(0)
    bench = Bench(args)
    if not bench.dist:
        bench.main()
        return 0
    import torch.distributed as dist  # noqa: PLC0415

    try:
        bench.main()
        # every rank past its last collective before any tears its group down: gloo aborts a rank
        # (std::terminate) whose peer closed the connection under work still in flight
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
