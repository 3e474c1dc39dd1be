"""Selective recompute of cheap modules (GPT-2's tanh GELU, Hugging Face RMSNorms): gradients bit-identical to
the model run normally, fewer bytes saved, the modules restored on detach."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _offload_models import assert_identical, run_steps
from datapath.offload import TensorCache, is_cheap, set_cheap_recompute

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128,
                                  attn_implementation="eager", use_cache=False)
    return transformers.GPT2LMHeadModel(cfg).train()


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=128, max_position_embeddings=64, attention_dropout=0.1,
                                   attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, ids)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cheap_recompute_is_bit_identical(family: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = (_gpt2() if family == "gpt2" else _llama()).to(dtype)
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(3)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    n = set_cheap_recompute(model, True)
    assert n == (2 if family == "gpt2" else 5)  # one GELU per layer; two norms per layer and the final one
    got = run_steps(model, batches, _loss)
    assert_identical(ref, got)
    set_cheap_recompute(model, False)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_cheap_recompute_saves_fewer_bytes() -> None:
    torch.manual_seed(1)
    model = _gpt2().to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 32))
    before = _saved_bytes(model, ids)
    set_cheap_recompute(model, True)
    after = _saved_bytes(model, ids)
    # each GELU saved its input and three more tensors of that size: three fewer per layer
    gelu_in = 4 * 32 * 4 * 64 * 2
    assert before - after >= 3 * gelu_in * 2, (before, after)


@pytest.mark.slow
def test_cheap_recompute_under_autocast_and_in_the_cache() -> None:
    torch.manual_seed(2)
    model = _llama()
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(3)]

    def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _loss(m, ids)

    ref = run_steps(copy.deepcopy(model), batches, loss)
    cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True)
    cache.attach(model)
    assert sum(1 for m in model.modules() if "forward" in m.__dict__) == 5
    got = run_steps(model, batches, loss, ctx=cache)
    assert_identical(ref, got)
    cache.close()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_what_is_cheap() -> None:
    assert is_cheap(transformers.activations.NewGELUActivation())
    assert not is_cheap(nn.GELU(approximate="tanh"))  # one kernel: saves only its input already
    assert not is_cheap(nn.Linear(4, 4))
