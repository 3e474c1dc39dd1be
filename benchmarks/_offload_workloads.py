"""B4's workloads (`benchmarks/offload.py`): the models, their batches and losses, and torchtune's offloader.

HF Llama (hidden 4096, 6 layers, 32 heads, intermediate 11008, vocab 32000; micro-batch 4,
sequence 2048), HF GPT-2 (n_embd 1600, 12 layers; micro-batch 8, sequence 1024) and the GPT
stack H8192 L4 (micro-batch 8, sequence 1024), bf16 on CUDA, built from configs (no downloads);
``--cpu-smoke`` shrinks each to a few layers of width 64.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class DecoderLayer(nn.Module):
    """Pre-LN GPT layer: fused qkv (q, k, v are views), causal SDPA, GELU MLP."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    """The GPT H8192 L4 stack of the earlier B4 (input: hidden states; loss: mean square)."""

    def __init__(self, h: int, heads: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(h, heads) for _ in range(layers))
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return x


def _hf_gc(model: nn.Module, on: bool) -> None:
    """Hugging Face gradient checkpointing on/off (non-reentrant), across transformers versions."""
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        fn = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        fn()


class Workload:
    """A model, a batch and a loss; ``recompute(on)`` switches the model's own checkpointing."""

    def __init__(self, name: str, model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor],
                 recompute: Callable[[bool], None]) -> None:
        self.name, self.model, self.batch, self.loss, self.recompute = name, model, batch, loss, recompute


def build(name: str, device: torch.device, smoke: bool) -> Workload:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if name == "gpt-h8192":
        h, heads, layers, mb, seq = (128, 4, 3, 2, 64) if smoke else (8192, 64, 4, 8, 1024)
        with torch.device(device):
            model = Stack(h, heads, layers).to(dtype)
        x = torch.randn(mb, seq, h, device=device, dtype=dtype)
        return Workload(name, model, x, lambda m, b: m(b.clone()).float().square().mean(),
                        lambda on: setattr(model, "recompute", on))
    import transformers  # noqa: PLC0415

    if name == "llama":
        kw = dict(hidden_size=4096, num_hidden_layers=6, num_attention_heads=32, intermediate_size=11008,
                  vocab_size=32000, max_position_embeddings=2048)
        mb, seq = 4, 2048
        if smoke:
            kw.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=172,
                      vocab_size=256, max_position_embeddings=64)
            mb, seq = 2, 32
        cfg = transformers.LlamaConfig(**kw, attn_implementation="sdpa", use_cache=False)
        cls: Any = transformers.LlamaForCausalLM
    elif name == "gpt2":
        kw = dict(n_embd=1600, n_layer=12, n_head=25, vocab_size=50257, n_positions=1024)
        mb, seq = 8, 1024
        if smoke:
            kw.update(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
            mb, seq = 2, 32
        cfg = transformers.GPT2Config(**kw, attn_implementation="sdpa", use_cache=False)
        cls = transformers.GPT2LMHeadModel
    else:
        raise SystemExit(f"unknown model {name!r}")
    with torch.device(device):
        model = cls(cfg).to(dtype)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), generator=g).to(device)
    return Workload(name, model, ids, lambda m, b: m(input_ids=b, labels=b).loss, lambda on: _hf_gc(model, on))


TORCHTUNE_HOW = ""


def torchtune_offload() -> tuple[Any, str | None]:
    """torchtune's OffloadActivations class, or None and why not.

    ``import torchtune`` pulls Hugging Face ``datasets`` (absent on the GPU machine) through its
    top-level ``__init__``; OffloadActivations itself needs only torch, torchao and
    ``torchtune.modules``.  When the package import fails, the unmodified module
    ``torchtune/training/_activation_offloading.py`` of the installed wheel is imported without
    running the two package ``__init__`` files above it (recorded in the JSON).
    """
    global TORCHTUNE_HOW
    try:
        from torchtune.training import OffloadActivations  # noqa: PLC0415

        TORCHTUNE_HOW = "import torchtune.training"
        return OffloadActivations, None
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to try the module alone
        first = f"{type(exc).__name__}: {exc}"[:200]
    try:
        import types  # noqa: PLC0415

        for name in ("torchtune", "torchtune.training"):
            for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[k]
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{name} is not installed")
            mod = types.ModuleType(name)
            mod.__path__ = list(spec.submodule_search_locations)
            sys.modules[name] = mod
        from torchtune.training._activation_offloading import OffloadActivations  # noqa: PLC0415

        TORCHTUNE_HOW = f"torchtune/training/_activation_offloading.py alone (package import failed: {first})"
        return OffloadActivations, None
    except Exception as exc:  # noqa: BLE001
        return None, f"{first}; module alone: {type(exc).__name__}: {exc}"[:400]
