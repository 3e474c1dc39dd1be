"""A differential fuzz of activation offloading: random models, random configurations, the plain steps as reference.

    from datapath.testing import run_offload_fuzz
    bad = [r for r in run_offload_fuzz(seed=0, count=40) if not r.ok]
    print(bad[0].reproduction())                  # python source re-running that case alone

Each case draws (`make_offload_case`, seeded by the run's seed and the case's index alone) a small model whose
saved tensors take the forms autograd hands a saved-tensor hook: views of one storage (a fused q/k/v projection
split in three), transposed and other non-contiguous views, tensors updated in place before they are saved, integer
indices (a gather, a top-k routing whose shapes depend on the data), boolean masks, float64 and bfloat16, one tensor
saved by every block (a memory every block attends to), tied weights, dropout, blocks under the user's own
``torch.utils.checkpoint``; and a configuration: everything
offloaded to pinned host memory, to files, or to a host tier too small for the step (the rest to files), the
adaptive policy, or a ``memory_budget`` of the resident memory plus a random share of what a plain step adds to
it, with a fast or a slow store (offloading or recomputing blocks), with a random ``min_bytes``, prefetch
distance and units (blocks or leaves), and outside a budget every block possibly recomputed with its attention
outputs kept or offloaded to an attention store (one with no room for most, some cases);
and a training loop: one micro-batch a step, two accumulated, two interleaved as a pipeline schedule runs them
(both forwards, then both backwards, with micro-batch hints), or a ``torch.no_grad`` forward before the step; some
cases freeze the embedding and the q/k/v projections.  On the file targets a case may make one write (ENOSPC or
EIO) or one read (EIO) of the file engine fail: the step must raise `OffloadError` with that errno (a failed write
with ``on_error="keep"`` keeps the tensor instead, and the steps stay bit-identical) and leave no file behind once
the next backward has run (PyTorch keeps a failed backward's unfinished work, and with it the step's graph, queued
on the thread until then).  The fault is on call ``fault_at`` of that kind; a run that makes fewer such calls is
run again (up to three times) with the fault on call ``fault_at`` modulo half the calls the run before made (how
many calls a run makes moves with its timing: stores a backward overtakes are not written); where the case made
none, the fault is tried with ``min_bytes=0`` (a higher ``min_bytes`` may keep every storage in memory; the host
tier may hold them all), and where that makes none either the case passes as "fault not reached", counted apart:
it tested no fault.
`run_offload_case` trains the case's steps (seeded per step, a plain SGD update between steps) without and with
offloading and requires losses and every gradient equal bit for bit, no file left behind, and on a budget (16-18
steps: it profiles, plans and tries plans first) its last step within 3% of it, or the budget refused with an
`OffloadConfigError` that names the measured minimum.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import gc
import os
import pathlib
import random
import tempfile
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from datapath.offload import (
    AttentionStore, HostStore, OffloadConfigError, OffloadError, Streams, TensorCache, set_recompute,
)

FEATURES = ("qkv_views", "transposed", "inplace", "gather", "mask", "routing", "memory", "norm", "checkpoint")
CONFIGS = ("host", "ssd", "tiered", "adaptive", "budget_fast", "budget_slow")
LOOPS = ("plain", "accumulate", "interleaved", "eval")


@dataclasses.dataclass(frozen=True)
class OffloadCase:
    """One drawn case: the model (``width`` a multiple of ``heads``; ``features`` each block uses), its data
    (``steps`` batches of [batch, seq] token ids below ``vocab``), its dtype and the offload configuration."""

    seed: int
    index: int
    layers: int
    width: int
    heads: int
    vocab: int
    batch: int
    seq: int
    steps: int
    dtype: torch.dtype
    dropout: float
    tied: bool
    features: tuple[str, ...]
    config: str
    fraction: float        # memory_budget: resident memory + this share of what a plain step adds
    min_bytes: int
    prefetch_distance: int
    loop: str = "plain"    # one of LOOPS
    frozen: bool = False   # the embedding and every block's q/k/v projection frozen (adapter-style fine-tuning)
    units: str | None = None  # attach(units=...): None (the policy's default), "blocks" or "leaves"
    fault: str = "none"    # files only: "write" or "read": the ``fault_at``-th call of that kind fails (counted from
    fault_at: int = 0      # 0; past the calls a run makes: ``fault_at`` modulo half of them, in a second run)
    fault_errno: int = errno.EIO
    on_error: str = "raise"  # TensorCache(on_error=...): "raise" or "keep" (a failed store keeps the tensor)
    attention: str = "none"  # every block recomputed, its attention outputs: "none" (not recomputed), "saved",
    attention_room: int = 0  # "offloaded" (to an `AttentionStore` of this many bytes) or "mixed" (alternating)


@dataclasses.dataclass
class OffloadCaseResult:
    case: OffloadCase
    ok: bool
    outcome: str           # "identical", "raised" (the injected fault), "refused" (a budget below the floor),
    detail: str = ""       # "fault not reached" (no call of the faulted kind: passed, testing no fault) or what failed
    fault_call: int | None = None  # the call of the faulted kind that failed (None: no fault drawn, or none failed)
    fault_calls: int = 0   # the calls of that kind the (last) run made
    fault_min_bytes: int | None = None  # the fault ran with this min_bytes, the case's own making no file I/O

    def reproduction(self) -> str:
        c = self.case
        return ("from datapath.testing.fuzz_offload import make_offload_case, run_offload_case\n"
                f"print(run_offload_case(make_offload_case({c.seed}, {c.index})))")


def make_offload_case(seed: int, index: int) -> OffloadCase:
    """Case ``index`` of run ``seed`` (the same case whatever ran before it)."""
    rng = random.Random(seed * 1_000_003 + index)
    heads = rng.choice([1, 2, 4])
    config = rng.choice(CONFIGS)
    fields = dict(
        seed=seed, index=index, layers=rng.randint(1, 4), width=heads * rng.choice([4, 8, 12, 16]), heads=heads,
        vocab=rng.choice([17, 64, 100]), batch=rng.randint(1, 4), seq=rng.choice([5, 16, 33]),
        # a budget settles, or is refused, within ~9 steps (profile, plan, trials, the floor's trial); with
        # interleaved micro-batches it plans between steps only, and takes up to ~15
        steps=rng.randint(16, 18) if config.startswith("budget") else rng.randint(3, 5),
        dtype=rng.choices([torch.float32, torch.float64, torch.bfloat16], [6, 2, 2])[0],
        dropout=rng.choice([0.0, 0.1, 0.3]), tied=rng.random() < 0.5,
        features=tuple(f for f in FEATURES if rng.random() < 0.5),
        config=config, fraction=round(rng.uniform(0.5, 0.95), 3),
        min_bytes=rng.choice([0, 256, 4096]), prefetch_distance=rng.randint(1, 3), loop=rng.choice(LOOPS),
        frozen=rng.random() < 0.3,
        units=None if config.startswith("budget") else rng.choice([None, "blocks", "leaves"]),
        **_fault(rng, config))
    return OffloadCase(**fields, **_attention(rng, config, fields["features"]))  # type: ignore[arg-type]


def _attention(rng: random.Random, config: str, features: tuple[str, ...]) -> dict[str, Any]:
    """Blocks recomputed with their attention outputs kept or offloaded (drawn after the fault: the fields before do
    not depend on it).  Not on a budget (its plans set the blocks' recomputation themselves), nor with the user's
    own checkpointing of the blocks."""
    mode = rng.choice(["none", "none", "saved", "offloaded", "mixed"])
    room = rng.choice([1 << 30, 1 << 30, 12 << 10])  # 12 KiB: most outputs find no room and stay on the device
    if config.startswith("budget") or "checkpoint" in features or mode == "none":
        return {}
    return dict(attention=mode, attention_room=room)


def _fault(rng: random.Random, config: str) -> dict[str, Any]:
    """An I/O fault for the file targets (drawn last: the fields before it do not depend on it)."""
    fault = rng.choice(["none", "write", "read"])
    at, code, on_error = rng.randint(0, 12), rng.choice([errno.ENOSPC, errno.EIO]), rng.choice(["raise", "keep"])
    if config not in ("ssd", "tiered"):
        return {}
    return dict(fault=fault, fault_at=at, fault_errno=code if fault == "write" else errno.EIO, on_error=on_error)


class _Block(nn.Module):
    """Pre-norm residual block using the case's ``features`` (input and output [batch, seq, width])."""

    def __init__(self, c: OffloadCase) -> None:
        super().__init__()
        w, f = c.width, set(c.features)
        self.f, self.heads, self.p = f, c.heads, c.dropout
        self.attend = "qkv_views" in f or c.attention != "none"  # a case recomputing attention has attention
        self.norm = nn.LayerNorm(w) if "norm" in f else nn.Identity()
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.up = nn.Linear(w, 2 * w)
        self.down = nn.Linear(2 * w, w)
        self.gate = nn.Linear(w, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, w, w) / w ** 0.5)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        b, s, w = x.shape
        h = self.norm(x)
        if self.attend:  # three views of one storage, each saved by attention
            q, k, v = self.qkv(h).view(b, s, 3, self.heads, w // self.heads).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
            h = self.proj(o.transpose(1, 2).reshape(b, s, w))
        else:
            h = self.proj(self.qkv(h)[..., :w])
        if "transposed" in self.f:  # a non-contiguous operand saved by the matmul
            h = h + h @ (h.transpose(1, 2) @ h) / (s * w)
        if "memory" in self.f and memory is not None:  # one tensor saved by every block
            h = h + torch.softmax(h @ memory.transpose(1, 2) / w ** 0.5, -1) @ memory
        u = self.up(F.dropout(h, self.p, self.training))
        if "inplace" in self.f:  # updated in place, then saved by the activation
            u.mul_(0.5).add_(0.1)
        u = F.gelu(u)
        if "mask" in self.f:  # a boolean mask saved by where
            u = torch.where(u > 0.05, u, u * 0.1)
        h = self.down(u)
        if "gather" in self.f:  # int64 indices saved by gather
            idx = h.detach().argsort(-1)
            h = h + torch.gather(h, -1, idx) * 0.5
        if "routing" in self.f:  # data-dependent shapes: each token to its top expert
            flat = h.reshape(-1, w)
            top = self.gate(flat).argmax(-1)
            out = torch.zeros_like(flat)
            for e in range(self.experts.shape[0]):
                rows = (top == e).nonzero().squeeze(1)
                if rows.numel():
                    out = out.index_add(0, rows, flat.index_select(0, rows) @ self.experts[e])
            h = h + out.view(b, s, w)
        return x + h


class FuzzModel(nn.Module):
    """Embedding, the case's blocks in a ModuleList (the offload units), a norm and an LM head."""

    def __init__(self, c: OffloadCase) -> None:
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.width)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.out_norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.emb.weight
        self.memory = "memory" in c.features
        self.checkpoint = "checkpoint" in c.features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        memory = torch.tanh(x) if self.memory else None
        for blk in self.blocks:
            if self.checkpoint:  # the user's own checkpointing inside the offloaded model
                x = checkpoint(blk, x, memory, use_reentrant=False)
            else:
                x = blk(x, memory)
        logits = self.head(self.out_norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _steps(model: nn.Module, batches: list[torch.Tensor], cache: TensorCache | None, seed: int, loop: str
           ) -> list[tuple[torch.Tensor, list[torch.Tensor | None]]]:
    """Per step (``batches[i]``: [batch, seq] ids): the loss and every parameter's gradient, then a plain SGD update.
    ``loop``: ``plain`` (one forward and backward), ``accumulate`` (two micro-batches, one after the other, their
    gradients summed), ``interleaved`` (both forwards, then both backwards in reverse order, with the
    `TensorCache.set_microbatch` hints a pipeline schedule gives), ``eval`` (a forward under ``torch.no_grad``
    first, as a validation pass in the loop)."""
    out = []
    for i, ids in enumerate(batches):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(seed + i)  # the same dropout masks with and without offloading
        with cache if cache is not None else contextlib.nullcontext():
            if loop == "eval":
                with torch.no_grad():
                    model(ids)
            if loop in ("accumulate", "interleaved") and ids.shape[0] > 1:
                parts = list(ids.chunk(2))
            else:
                parts = [ids]
            losses = []
            if loop == "interleaved":
                for k, part in enumerate(parts):
                    if cache is not None:
                        cache.set_microbatch(k)
                    losses.append(model(part))
                for k in reversed(range(len(parts))):
                    if cache is not None:
                        cache.set_microbatch(k)
                    losses[k].backward()
            else:
                for part in parts:
                    losses.append(model(part))
                    losses[-1].backward()
            loss = torch.stack([x.detach() for x in losses]).sum()
        out.append((loss.clone(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(1e-2 * p.grad)
    return out


def _difference(ref: list[Any], got: list[Any]) -> str:
    """'' when every loss and gradient is equal bit for bit, else where the first difference is."""
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(ref, got)):
        if not torch.equal(l0, l1):
            return f"step {step}: loss {l0.item()!r} != {l1.item()!r}"
        for k, (a, b) in enumerate(zip(g0, g1)):
            if (a is None) != (b is None):
                return f"step {step}: gradient {k} present in one run only"
            if a is not None and not torch.equal(a, b):
                return f"step {step}: gradient {k} differs by up to {(a - b).abs().max().item():.3g}"
    return "" if len(ref) == len(got) else f"{len(ref)} reference steps, {len(got)} offloaded"


def _keep_peak(model: nn.Module, ids: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """One plain step's memory (bytes): what was resident before it and its peak -- the CUDA allocator's, or on
    the CPU the datapath meter's (parameters, then what the step's ops made)."""
    m = copy.deepcopy(model)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(ids).backward()
        torch.cuda.synchronize()
        return base, torch.cuda.max_memory_allocated()
    from datapath.offload.memory_meter import CpuMeter  # noqa: PLC0415

    base = sum(p.numel() * p.element_size() for p in m.parameters())
    meter = CpuMeter(base)
    meter.lap()
    with meter:
        m(ids).backward()
    return base, meter.lap()


def _is_probe(fd: int) -> bool:
    try:
        return "probe-" in os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc: every call counts
        return False


def _inject(cache: TensorCache, case: OffloadCase, at: int, seen: dict[str, int]) -> None:
    """Make the ``at``-th write (``pwrite``) or read (``preadv``) of the cache's file engine fail with
    ``fault_errno`` (the store's bandwidth probe not counted: its failure is ignored by design, the planner then
    uses measured transfers); the calls and the faults raised are counted in ``seen``."""
    fs = cache.file_store
    if case.fault == "none" or fs is None:
        return
    name = "pwrite" if case.fault == "write" else "preadv"
    real = getattr(fs.posix, name)

    def failing(*args: Any) -> int:
        if _is_probe(args[0]):  # the bandwidth probe's file: a failed probe is meant to go unnoticed
            return real(*args)
        seen["calls"] += 1
        if seen["calls"] - 1 == at:
            seen["fired"] += 1
            raise OSError(case.fault_errno, os.strerror(case.fault_errno))
        return real(*args)
    setattr(fs.posix, name, failing)


def run_offload_case(case: OffloadCase, device: str | torch.device = "cpu") -> OffloadCaseResult:
    """Train ``case`` without and with offloading on ``device``; the comparison (never raises for a failed check).

    A fault past the calls the run made is moved onto one it makes (``fault_at`` modulo half of them) and the case run
    again; where the case made no call of the faulted kind, the fault is tried with ``min_bytes=0`` (the case itself
    having passed); a run with no such call still is "fault not reached" (passed, and counted apart)."""
    dev = torch.device(device)
    try:
        torch.manual_seed(case.seed * 7919 + case.index)
        model = FuzzModel(case).to(dev, case.dtype).train()
        if case.frozen:
            model.emb.weight.requires_grad_(False)
            for blk in model.blocks:
                blk.qkv.requires_grad_(False)
        g = torch.Generator().manual_seed(case.index)
        batches = [torch.randint(0, case.vocab, (case.batch, case.seq), generator=g).to(dev)
                   for _ in range(case.steps)]
        ref = _steps(copy.deepcopy(model), batches, None, case.index, case.loop)
        at, seen, run = case.fault_at, {"calls": 0, "fired": 0}, case
        r = _offloaded(case, copy.deepcopy(model), batches, ref, dev, at, seen)
        if case.fault != "none" and r.ok and not seen["fired"] and not seen["calls"] and case.min_bytes:
            # no storage reached the files (min_bytes kept them all in memory, or the host tier held them): the
            # case itself passed; the fault goes to the case with every storage a candidate
            run, seen = dataclasses.replace(case, min_bytes=0), {"calls": 0, "fired": 0}
            r = _offloaded(run, copy.deepcopy(model), batches, ref, dev, at, seen)
        for _ in range(3):  # fewer calls made: fault on one of the first half (a run may make fewer than the last)
            if not (case.fault != "none" and r.ok and not seen["fired"] and seen["calls"]):
                break
            at, seen = case.fault_at % max(1, seen["calls"] // 2), {"calls": 0, "fired": 0}
            r = _offloaded(run, copy.deepcopy(model), batches, ref, dev, at, seen)
        r.case, r.fault_calls = case, seen["calls"]
        if run is not case:
            r.fault_min_bytes = run.min_bytes
            r.detail = f"with min_bytes {run.min_bytes} (the case's own {case.min_bytes} made no file I/O): {r.detail}"
        if seen["fired"]:
            r.fault_call = at
        elif case.fault != "none" and r.ok:
            r.outcome, r.detail = "fault not reached", (
                f"the {case.fault} fault on call {at} was never reached: the run made {seen['calls']} "
                f"{case.fault}s of the file engine; {r.detail}")
        return r
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported with its case
        return OffloadCaseResult(case, False, f"{type(exc).__name__}: {str(exc)[:200]}", traceback.format_exc())


def _offloaded(case: OffloadCase, model: nn.Module, batches: list[torch.Tensor], ref: list[Any],
               dev: torch.device, fault_at: int, seen: dict[str, int]) -> OffloadCaseResult:
    """Train ``model`` on ``batches`` with offloading (the fault, if any, on call ``fault_at``; the calls of its
    kind made and failed are counted in ``seen``) and compare with ``ref``."""
    try:
        with tempfile.TemporaryDirectory(prefix="datapath-fuzz-") as tmp:
            opts: dict[str, Any] = dict(min_bytes=case.min_bytes, prefetch_distance=case.prefetch_distance,
                                        offload_cpu_tensors=dev.type == "cpu", on_error=case.on_error)
            budget = None
            if case.config in ("host", "adaptive"):
                cache = TensorCache("host", policy="all" if case.config == "host" else "adaptive", **opts)
            elif case.config in ("ssd", "tiered"):
                host = (16 << 10) if case.config == "tiered" else None
                cache = TensorCache(case.config, tmp, host_budget_bytes=host, **opts)
            else:
                # a share of what the step adds to the resident memory: on CUDA a tiny model's step is a sliver of
                # what is resident (the reference's results, the allocator's blocks), below which no plan goes
                base, peak = _keep_peak(model, batches[0], dev)
                budget = max(1, base + int((peak - base) * case.fraction))
                cache = TensorCache("host", memory_budget=budget, **opts)
                if case.config == "budget_slow":
                    cache.bandwidth = lambda: (1e5, 1e5)
            _inject(cache, case, fault_at, seen)
            raised: OffloadError | None = None
            attention = _recompute_attention(case, model, dev)
            try:
                cache.attach(model, units=case.units)
                got = _steps(model, batches, cache, case.index, case.loop)
            except OffloadConfigError as exc:  # a budget below what the model can reach: refused, saying why
                if budget is not None and ("minimum" in str(exc) or "raise the budget" in str(exc)):
                    return OffloadCaseResult(case, True, "refused", str(exc)[:200])
                raise
            except OffloadError as exc:  # an injected fault: it must surface as this error, with its errno
                raised = exc
            finally:
                try:  # a fault in the last step's stores surfaces here, when the cache is closed
                    cache.close(raise_errors=raised is None)
                except OffloadError as exc:
                    raised = exc
            if raised is not None:
                message = f"{raised.errno}: {str(raised)[:200]}"
                wanted = seen["fired"] and (case.fault == "read" or case.on_error == "raise") and \
                    raised.errno == case.fault_errno
                del raised
                # PyTorch keeps a backward's unfinished work (the failed step's graph, and with it the offloaded
                # copies) queued on the thread until the next backward there: the next step's
                torch.ones(1, device=dev, requires_grad=True).sum().backward()
                gc.collect()  # the error's traceback held the step's graph too
                left = [str(p) for p in pathlib.Path(tmp).rglob("*") if p.is_file()]
                if not wanted:
                    return OffloadCaseResult(case, False, "unexpected OffloadError", message)
                if left:
                    return OffloadCaseResult(case, False, "files left behind after a fault", ", ".join(left[:3]))
                return OffloadCaseResult(case, True, "raised", message)
            if seen["fired"] and (case.fault == "read" or case.on_error == "raise"):
                return OffloadCaseResult(case, False, "fault swallowed",
                                         f"the injected {case.fault} error never reached the step")
            diff = _difference(ref, got)
            if diff:
                return OffloadCaseResult(case, False, "gradients differ", diff)
            left = [str(p) for p in pathlib.Path(tmp).rglob("*") if p.is_file()]
            if left:
                return OffloadCaseResult(case, False, "files left behind", ", ".join(left[:3]))
            peaks = getattr(cache.policy, "peaks", [])
            if budget is not None and peaks and peaks[-1] > 1.03 * budget:
                return OffloadCaseResult(case, False, "budget exceeded",
                                         f"last step {peaks[-1]} bytes over a budget of {budget}")
            detail = f"{cache.stats.bytes_offloaded} bytes offloaded"
            if attention is not None:
                del got
                gc.collect()
                attention._drain()  # what the next step's first save does: every read and orphan released
                if attention.store.in_use:
                    return OffloadCaseResult(case, False, "attention store not emptied",
                                             f"{attention.store.in_use} bytes still held after the last step")
                detail += (f"; attention outputs {attention.stored_bytes} bytes stored, {attention.kept_bytes} kept "
                           f"(no room)")
        return OffloadCaseResult(case, True, "identical", detail)
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported with its case
        return OffloadCaseResult(case, False, f"{type(exc).__name__}: {str(exc)[:200]}", traceback.format_exc())


def _recompute_attention(case: OffloadCase, model: nn.Module, dev: torch.device) -> AttentionStore | None:
    """Put every block of ``model`` under recomputation with its attention outputs as ``case.attention`` says;
    the `AttentionStore` the offloaded ones go to (None where none do)."""
    if case.attention == "none":
        return None
    blocks = list(model.blocks)
    every = range(len(blocks))
    moved = [i for i in every if case.attention == "offloaded" or (case.attention == "mixed" and i % 2 == 0)]
    saved = [i for i in every if case.attention == "saved" or (case.attention == "mixed" and i % 2 == 1)]
    store = None
    if moved:
        streams: dict[torch.device, Streams] = {}
        store = AttentionStore(HostStore(case.attention_room, pinned=dev.type == "cuda"),
                               lambda d: streams.setdefault(d, Streams(d)), chunk_bytes=4096, min_bytes=0)
    set_recompute(blocks, every, saved, moved, store)
    return store


def run_offload_fuzz(seed: int = 0, count: int = 40, device: str | torch.device = "cpu") -> list[OffloadCaseResult]:
    """Cases 0..count-1 of run ``seed``, in one process, in order."""
    return [run_offload_case(make_offload_case(seed, i), device) for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="differential fuzz of activation offloading (bit-identical gradients)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    bad = faults = reached = 0
    for i in range(a.count):
        r = run_offload_case(make_offload_case(a.seed, i), a.device)
        c = r.case
        fault = ""
        if c.fault != "none":
            faults += 1
            reached += r.fault_call is not None
            at = "not reached" if r.fault_call is None else f"on call {r.fault_call}"
            mb = "" if r.fault_min_bytes is None else f" with min_bytes {r.fault_min_bytes}"
            fault = f" ({c.fault} fault {at} of {r.fault_calls}{mb}, on_error={c.on_error})"
        print(f"case {i:4d} {c.config:11s} {c.loop:11s} {str(c.dtype)[6:]:8s} layers {c.layers} "
              f"{','.join(c.features) or '-'}{' frozen' if c.frozen else ''}"
              f"{'' if c.attention == 'none' else f' attention {c.attention}'}: {r.outcome}{fault}", flush=True)
        if not r.ok:
            bad += 1
            print(r.detail, "\n", r.reproduction(), flush=True)
    print(summary_line(a.count - bad, a.count, faults, reached))
    return 1 if bad else 0


def summary_line(passed: int, count: int, faults: int, reached: int) -> str:
    """The fuzz's last line: the cases passed, and of the cases that drew a fault how many never reached it (they
    passed testing no fault)."""
    line = f"{passed} of {count} cases passed"
    if faults:
        line += f" ({faults - reached} with a fault that was never reached; {reached} of {faults} faults reached)"
    return line


if __name__ == "__main__":
    raise SystemExit(main())
