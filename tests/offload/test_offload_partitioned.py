"""Compiled blocks recomputed by their compiled region's partitioner (``set_recompute(..., partitioned=...)``, CPU
inductor): no checkpoint around the region, the compiler saving a share of what the plain compiled block saves;
gradients those of the compiled model to rounding; the budget's trial measures such a plan where one it tries
stores nothing."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _offload_models import assert_identical, cpu_hf_checkpoint_peak, run_steps
from datapath.offload import TensorCache, compile_blocks, set_recompute, uncompile_blocks
from datapath.offload.recompute import is_partitioned

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 3, seed: int = 11) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                                   num_attention_heads=4, vocab_size=128, max_position_embeddings=128,
                                   attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors one forward saves for its backward (through the saved-tensor hooks)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


@pytest.mark.slow
def test_partitioned_compiled_blocks_train_as_the_compiled_model_saving_less() -> None:
    """Every block partitioned: losses and gradients of the compiled model to float32 rounding (another compiled
    graph), over steps of random lengths; the forward saves less than the plain compiled blocks and more than
    checkpointing them (the partitioner keeps the outputs worth keeping)."""
    model = _llama()
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, n), generator=gen) for n in (48, 80, 48)]
    ref_model = copy.deepcopy(model)
    compile_blocks(ref_model)
    ref = run_steps(ref_model, batches, _loss)
    kept = _saved_bytes(ref_model, batches[0])
    uncompile_blocks(ref_model)

    compile_blocks(model)
    blocks = list(model.model.layers)
    set_recompute(blocks, [0, 1, 2])
    checkpointed = _saved_bytes(model, batches[0])
    set_recompute(blocks, [0, 1, 2], partitioned=[0, 1, 2])
    assert all(is_partitioned(b) for b in blocks)
    got = run_steps(model, batches, _loss)
    split = _saved_bytes(model, batches[0])
    for (l0, g0), (l1, g1) in zip(ref, got, strict=True):
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert checkpointed < split < kept, (checkpointed, split, kept)
    set_recompute(blocks, [])
    assert not any(is_partitioned(b) for b in blocks)
    uncompile_blocks(model)


def test_set_recompute_names_blocks_it_cannot_partition() -> None:
    model = _llama(2)
    blocks = list(model.model.layers)
    with pytest.raises(ValueError, match=r"blocks \[0\] are not compiled by datapath"):
        set_recompute(blocks, [0], partitioned=[0])
    compile_blocks(model)
    with pytest.raises(ValueError, match=r"partitioned blocks \[1\] are not recomputed"):
        set_recompute(blocks, [0], partitioned=[1])
    with pytest.raises(ValueError, match=r"blocks \[0\] are both partitioned and keep their attention"):
        set_recompute(blocks, [0], partitioned=[0], attention_saved=[0])
    assert not any(is_partitioned(b) for b in blocks)
    uncompile_blocks(model)


@pytest.mark.slow
def test_a_budget_trial_measures_compiled_blocks_partitioned() -> None:
    """A budget over compiled blocks whose trial runs checkpointing's plan (storing nothing) runs it partitioned
    too, and records what that step measured; a plan that stores is never partitioned.  (On the CPU the budget's
    memory meter keeps TorchDynamo from compiling: the blocks run eagerly, gradients bit-identical to the eager
    model's; B6 measures the compiled plan on the GPU.)"""
    model = _llama(4)
    batches = [torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(5)) for _ in range(10)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    budget = int(1.6 * cpu_hf_checkpoint_peak(model, _loss, batches[0]))
    cache = TensorCache("host", memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True, compile=True)
    cache.attach(model)
    got = run_steps(model, batches, _loss, ctx=cache)
    assert_identical(ref, got)
    tried = [p for r in cache.policy.trials for p in r["plans"]]
    cache.close()
    split = [p for p in tried if p["partitioned"]]
    assert split, tried
    for p in split:
        assert p["partitioned"] == p["recompute"] and p["offload_bytes"] == 0 and p["cut_segment"] == 0, p
        assert p["step_ms"] > 0 and p["peak"] > 0, p
    assert all(not p["partitioned"] for p in tried if p["offload_bytes"]), tried
