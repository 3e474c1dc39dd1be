"""What people train, on a GPU: Hugging Face causal LMs (Llama, GPT-2, Qwen2, Mistral; sdpa and eager
attention; with and without HF gradient checkpointing; bf16 autocast; dropout on), 3+ optimizer steps
with bit-identical gradients to no offloading, under ``policy="all"`` and a memory budget; and a
torch.compile'd model under a budget."""
from __future__ import annotations

import contextlib
import copy
import gc
import re
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from datapath.offload import OffloadConfigError, TensorCache, compile_blocks, set_recompute

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "gpt2", "qwen2", "mistral"]
STEPS = 7  # budget: one step is profiled for memory, at most one for time, the rest are planned
PLANNED_BY = 2  # a budget's first planned step is at most the third


def build(family: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=512, attn_implementation=attn, use_cache=False)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=512, n_layer=3, n_head=8, n_positions=256, resid_pdrop=0.1,
                                      embd_pdrop=0.1, attn_pdrop=0.1, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        kw = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=256, attention_dropout=0.1, **common)
        cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
        model = cls[1](cls[0](**kw))
    return model.cuda().train()


def set_hf_checkpointing(model: torch.nn.Module, on: bool) -> None:
    if not on:
        return
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(model: torch.nn.Module, batches: list[torch.Tensor], ctx: Any = None,
          opt: torch.optim.Optimizer | None = None, peaks: list[int] | None = None,
          backend: SDPBackend = SDPBackend.MATH) -> list[Any]:
    """AdamW steps under bf16 autocast (deterministic attention by default: ``backend``); per step the loss and
    every gradient (copied to the host: the harness holds no device memory that grows from step to step)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for i, ids in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        if peaks is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with sdpa_kernel(backend), torch.autocast("cuda", dtype=torch.bfloat16):
            with ctx if ctx is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        if peaks is not None:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        out.append((loss.detach().cpu(), [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]))
        opt.step()
    return out


def assert_same(ref: list[Any], got: list[Any]) -> None:
    assert len(ref) == len(got)
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(ref, got)):
        assert torch.equal(l0, l1), f"step {step}: loss {l0.item()} != {l1.item()}"
        assert len(g0) == len(g1)
        for k, (a, b) in enumerate(zip(g0, g1)):
            assert torch.equal(a, b), f"step {step}: grad {k} differs by {(a.float() - b.float()).abs().max()}"


def release() -> None:
    """Free what earlier runs left (models held in reference cycles until a collection): every run starts
    from the same device memory, so peaks of different runs compare."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def keep_peak(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """(memory before a step, peak of the step) without offloading, optimizer state already made."""
    release()
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, [ids], opt=opt)  # AdamW state, cuBLAS workspaces
    for p in m.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train(m, [ids], opt=opt)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del m, opt
    release()
    return base, peak


def run_cache(model: torch.nn.Module, batches: list[torch.Tensor], *args: Any, peaks: list[int] | None = None,
              backend: SDPBackend = SDPBackend.MATH, **kw: Any) -> tuple[list[Any], Any]:
    """Train a copy of ``model`` under a new TensorCache; (losses and gradients, the closed cache)."""
    release()
    m = copy.deepcopy(model)
    cache = TensorCache(*args, **kw)
    try:
        cache.attach(m)
        got = train(m, batches, ctx=cache, peaks=peaks, backend=backend)
        cache.wait_io()
        assert cache.files() == []
    finally:
        cache.close(raise_errors=False)
        del m
        release()
    return got, cache


def _family_run(family: str, attn: str, hf_gc: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The model of ``family`` with ``attn`` attention (HF checkpointing on or off) and STEPS token batches."""
    model = build(family, attn)
    set_hf_checkpointing(model, hf_gc)
    g = torch.Generator(device="cuda").manual_seed(1)
    return model, [torch.randint(0, 512, (4, 256), device="cuda", generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize("hf_gc", [False, True], ids=["no-hf-gc", "hf-gc"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_bit_identical(family: str, attn: str, hf_gc: bool) -> None:
    """policy='all' on each HF family: gradients bit-identical to no offloading over STEPS optimizer steps."""
    model, batches = _family_run(family, attn, hf_gc)
    ref = train(copy.deepcopy(model), batches)
    got, cache = run_cache(model, batches, "host", min_bytes=1 << 16)
    assert_same(ref, got)
    assert cache.stats.bytes_offloaded > 0 or hf_gc


@pytest.mark.parametrize("hf_gc", [False, True], ids=["no-hf-gc", "hf-gc"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_budget(family: str, attn: str, hf_gc: bool) -> None:
    """memory_budget half way from what offloading everything reaches to keep's peak: held, gradients identical."""
    model, batches = _family_run(family, attn, hf_gc)
    base, peak = keep_peak(model, batches[0])
    ref = train(copy.deepcopy(model), batches)
    all_peaks: list[int] = []
    run_cache(model, batches, "host", min_bytes=1 << 16, peaks=all_peaks)
    floor = max(all_peaks[1:])
    budget = int(floor + 0.5 * max(peak - floor, 0))
    got, cache = run_cache(model, batches, "host", memory_budget=budget, min_bytes=1 << 16)
    assert_same(ref, got)
    peaks = cache.policy.peaks
    assert peaks, "no planned step ran"
    assert cache.policy.planned_at is not None and cache.policy.planned_at <= PLANNED_BY, cache.policy.planned_at
    assert peaks[-1] <= 1.03 * budget, f"planned peaks {peaks} over the budget {budget} (floor {floor})"


def test_budget_below_the_floor_names_the_measured_minimum() -> None:
    """A budget under what a step needs with everything offloaded (here below the gradients alone): refused
    within the first steps with `OffloadConfigError`, naming a measured minimum above the budget."""
    model, batches = _family_run("llama", "sdpa", False)
    base, _ = keep_peak(model, batches[0])
    all_peaks: list[int] = []
    run_cache(model, batches, "host", min_bytes=1 << 16, peaks=all_peaks)
    budget = int(base + 0.1 * (max(all_peaks[1:]) - base))
    with pytest.raises(OffloadConfigError, match="measured minimum") as info:
        run_cache(model, batches, "host", memory_budget=budget, min_bytes=1 << 16)
    m = re.search(r"measured minimum for this model and batch is ([0-9.]+) (GB|MB)", str(info.value))
    assert m is not None, str(info.value)
    assert float(m.group(1)) * (1e9 if m.group(2) == "GB" else 1e6) > budget, (str(info.value), budget)


@pytest.mark.parametrize("target", ["ssd", "tiered"])
def test_llama_budget_on_files(target: str, tmp_path) -> None:
    model = build("llama", "sdpa")
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [torch.randint(0, 512, (4, 256), device="cuda", generator=g) for _ in range(STEPS)]
    base, peak = keep_peak(model, batches[0])
    ref = train(copy.deepcopy(model), batches)
    got, cache = run_cache(model, batches, target, str(tmp_path), memory_budget=int(base + 0.6 * (peak - base)),
                           min_bytes=1 << 16, host_budget_bytes=(4 << 20) if target == "tiered" else None)
    assert_same(ref, got)
    assert cache.policy.peaks


def test_compiled_llama_under_a_budget() -> None:
    """torch.compile'd model: the planner sees what the compiled graphs save, and the budget holds."""
    model = build("llama", "sdpa")
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, 512, (4, 256), device="cuda", generator=g) for _ in range(6)]
    base, peak = keep_peak(model, batches[0])
    ref = train(torch.compile(copy.deepcopy(model)), batches)
    budget = int(base + 0.85 * (peak - base))
    cache = TensorCache("host", memory_budget=budget, min_bytes=1 << 16)
    try:
        cache.attach(model)
        got = train(torch.compile(model), batches, ctx=cache)
        pol = cache.policy
        assert pol.peaks and pol.peaks[-1] <= 1.03 * budget, (pol.peaks, budget)
        # a step in which the compiler ran is profiled again (its times hold compile time): one step later
        assert pol.planned_at is not None and pol.planned_at <= PLANNED_BY + 1, pol.planned_at
    finally:
        cache.close(raise_errors=False)
    for (l0, _), (l1, _) in zip(ref, got):
        assert torch.allclose(l0.float(), l1.float(), rtol=2e-2), (l0, l1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_regionally_compiled_model_under_a_budget(family: str) -> None:
    """compile=True: datapath compiles each block (regional compilation) and plans on what the compiled blocks
    save: the budget holds from step 2 on, and the gradients are bit-identical to the same compiled blocks
    without offloading over STEPS AdamW steps (dropout on: recomputed compiled blocks replay their masks)."""
    model, batches = _family_run(family, "sdpa", False)
    release()
    ref_model = copy.deepcopy(model)
    compile_blocks(ref_model)
    compiled_peaks: list[int] = []
    ref = train(ref_model, batches, peaks=compiled_peaks)
    del ref_model
    all_peaks: list[int] = []  # the floor: the compiled blocks with everything offloaded
    run_cache(model, batches, "host", min_bytes=1 << 16, compile=True, peaks=all_peaks)
    floor, peak = max(all_peaks[1:]), max(compiled_peaks[1:])
    assert floor < peak, (floor, peak)
    budget = int(floor + 0.5 * (peak - floor))
    got, cache = run_cache(model, batches, "host", memory_budget=budget, min_bytes=1 << 16, compile=True)
    pol = cache.policy
    if any(p.attention_saved for p in pol.plans_run.values()):
        assert_compiled_close(ref, got)  # a plan ran blocks keeping their attention: another compiled graph
    else:
        assert_same(ref, got)
    assert pol.planned_at is not None and pol.planned_at <= PLANNED_BY + 1, pol.planned_at
    assert pol.peaks and pol.peaks[-1] <= 1.03 * budget, (pol.peaks, budget)
    # (the plan may keep everything: with the hooks outside the compiled regions the compiled blocks can fit the
    # budget as they are; B4 shows plans that offload and recompute compiled blocks, gradients identical)


def assert_compiled_close(ref: list[Any], got: list[Any]) -> None:
    """Losses and gradients of two differently compiled graphs of one computation: Inductor fuses a block
    compiled with its checkpoint inside otherwise than the plain block, so they agree to rounding, not bitwise."""
    assert len(ref) == len(got)
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(ref, got)):
        assert torch.allclose(l0.float(), l1.float(), rtol=1e-4), f"step {step}: loss {l0.item()} != {l1.item()}"
        for a, b in zip(g0, g1, strict=True):
            scale = a.float().abs().max().clamp_min(1e-12)
            assert (a.float() - b.float()).abs().max() / scale < 2e-2, f"step {step}: gradients differ"


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_compiled_llama_under_a_budget_tries_keeping_attention_in_its_compiled_regions(dropout: bool) -> None:
    """compile=True with the budget between compiled checkpointing's peak and keeping everything: the trial also
    runs checkpointing's recomputation with the blocks keeping their attention outputs inside their compiled
    regions, everything offloaded, under the budget; the gradients agree with the same compiled blocks without
    offloading (to rounding: another graph).  With attention dropout on, no such plan runs (its graph would
    draw other masks), and the gradients agree too (a changed mask would move them by far more than rounding)."""
    model, _ = _family_run("llama", "sdpa", False)
    if not dropout:
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.0
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [torch.randint(0, 512, (4, 256), device="cuda", generator=g) for _ in range(12)]
    release()
    ref_model = copy.deepcopy(model)
    compile_blocks(ref_model)
    flash = SDPBackend.FLASH_ATTENTION  # a fused attention op, whose outputs a block can keep
    keep_peaks: list[int] = []
    ref = train(ref_model, batches, backend=flash, peaks=keep_peaks)
    set_recompute(list(ref_model.model.layers), range(len(ref_model.model.layers)))
    ckpt_peaks: list[int] = []
    train(ref_model, batches[:3], peaks=ckpt_peaks, backend=flash)  # compiled checkpointing's peak
    del ref_model
    ckpt, keep = max(ckpt_peaks[1:]), max(keep_peaks[1:])
    budget = int(ckpt + 0.7 * (keep - ckpt))
    got, cache = run_cache(model, batches, "host", memory_budget=budget, min_bytes=1 << 16, compile=True,
                           backend=flash)
    tried = [p for r in cache.policy.trials for p in r["plans"]]
    ran = [p for p in cache.policy.plans_run.values() if p.attention_saved]
    assert cache.policy.peaks[-1] <= 1.03 * budget, (cache.policy.peaks, budget)
    if dropout:
        assert ran == [], ran
        assert_compiled_close(ref, got)  # (flash attention's backward need not be bitwise deterministic)
        return
    keeping = [p for p in tried if p["attention_saved"]]
    assert keeping, tried
    assert all(p["attention_saved"] == p["recompute"] and p["peak"] <= 1.03 * budget for p in keeping), keeping
    assert_compiled_close(ref, got)
