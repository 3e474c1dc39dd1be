"""Offloading on the Hugging Face model families people fine-tune, built from their `transformers` configs (tiny
sizes, random weights, dropout on, CPU): everything offloaded, and `memory_budget` with a fast store (it offloads)
and with a slow one (it recomputes blocks), each against the plain step, bit for bit, with the budget held.

Covers what the Llama/GPT-2 tests do not: sliding-window and soft-capped attention (Gemma 2), fused qkv and
gate-up projections (Phi-3), parallel attention and MLP (GPT-NeoX, Falcon), learned positions (OPT), routed
experts whose shapes depend on the data (Mixtral, Qwen2-MoE with a shared expert), an encoder with a masked-LM
head (BERT) and an encoder-decoder (T5: two stacks of blocks, relative position bias shared from the first).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from _offload_models import assert_identical, cpu_keep_peak, run_steps
from datapath.offload import TensorCache

transformers = pytest.importorskip("transformers")

VOCAB = 128
SMALL = dict(num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)


def _family(name: str) -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    """A tiny ``name`` model (seed 4, train mode) and its training loss on token ids [batch, seq] int64."""
    t = transformers
    torch.manual_seed(4)
    eager = dict(vocab_size=VOCAB, attn_implementation="eager")
    if name == "gemma2":
        cfg = t.Gemma2Config(hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                             attention_dropout=0.1, sliding_window=8, **SMALL, **eager)
        model: nn.Module = t.Gemma2ForCausalLM(cfg)
    elif name == "phi3":
        cfg = t.Phi3Config(hidden_size=64, intermediate_size=128, attention_dropout=0.1, resid_pdrop=0.1,
                           embd_pdrop=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2, **SMALL, **eager)
        model = t.Phi3ForCausalLM(cfg)
    elif name == "gpt_neox":
        cfg = t.GPTNeoXConfig(hidden_size=64, intermediate_size=128, attention_dropout=0.1, hidden_dropout=0.1,
                              **SMALL, **eager)
        model = t.GPTNeoXForCausalLM(cfg)
    elif name == "falcon":
        cfg = t.FalconConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, attention_dropout=0.1,
                             hidden_dropout=0.1, **eager)
        model = t.FalconForCausalLM(cfg)
    elif name == "opt":
        cfg = t.OPTConfig(hidden_size=64, ffn_dim=128, dropout=0.1, attention_dropout=0.1, word_embed_proj_dim=64,
                          **SMALL, **eager)
        model = t.OPTForCausalLM(cfg)
    elif name == "mixtral":
        cfg = t.MixtralConfig(hidden_size=64, intermediate_size=96, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, attention_dropout=0.1, **SMALL, **eager)
        model = t.MixtralForCausalLM(cfg)
    elif name == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64, num_key_value_heads=2, num_experts=4,
                               num_experts_per_tok=2, attention_dropout=0.1, **SMALL, **eager)
        model = t.Qwen2MoeForCausalLM(cfg)
    elif name == "bert":
        cfg = t.BertConfig(hidden_size=64, intermediate_size=128, hidden_dropout_prob=0.1,
                           attention_probs_dropout_prob=0.1, **SMALL, **eager)
        model = t.BertForMaskedLM(cfg)
    elif name == "t5":
        cfg = t.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                         dropout_rate=0.1, vocab_size=VOCAB, decoder_start_token_id=0)
        model = t.T5ForConditionalGeneration(cfg)

        def seq2seq(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return m(input_ids=ids, labels=ids.flip(1)).loss
        return model.train(), seq2seq
    else:
        raise KeyError(name)

    def lm(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss
    return model.train(), lm


FAMILIES = ["gemma2", "phi3", "gpt_neox", "falcon", "opt", "mixtral", "qwen2_moe", "bert", "t5"]


def _batches(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (4, 32), generator=g) for _ in range(n)]


def _cached(model: nn.Module, loss: Any, batches: list[torch.Tensor], slow_store: bool = False,
            **options: Any) -> tuple[TensorCache, list[Any]]:
    """``batches`` through a copy of ``model`` under a host TensorCache made with ``options`` (``slow_store``: its
    measured bandwidth 100 kB/s, far slower than the compute): the cache and, per step, the loss and gradients."""
    m = copy.deepcopy(model)
    cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True, **options)
    if slow_store:
        cache.bandwidth = lambda: (1e5, 1e5)
    cache.attach(m)
    return cache, run_steps(m, batches, loss, ctx=cache)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_offloaded_and_budgeted_steps_are_bit_identical(family: str) -> None:
    model, loss = _family(family)
    batches = _batches()
    ref = run_steps(copy.deepcopy(model), batches, loss)

    cache, got = _cached(model, loss, batches)  # everything offloaded
    assert cache.stats.bytes_offloaded > 0
    assert_identical(ref, got)  # dropout on: every mask, every expert's routing the same
    cache.close()

    keep = cpu_keep_peak(copy.deepcopy(model), loss, batches[0])
    for fraction, slow in ((0.7, False), (0.8, True)):  # a fast store: it offloads; a slow one: it recomputes
        budget = int(keep * fraction)
        cache, got = _cached(model, loss, batches, slow_store=slow, memory_budget=budget)
        assert_identical(ref, got)
        assert cache.models.blocks, "the model's blocks (its largest ModuleList) were found"
        assert cache.plan is not None
        peaks = cache.policy.peaks
        assert peaks and peaks[-1] <= 1.03 * budget, (family, fraction, peaks, budget)
        cache.close()
