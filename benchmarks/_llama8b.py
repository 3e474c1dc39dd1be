"""B6's workload (`benchmarks/offload_scale.py`): the Llama-3-8B shape from a config, LoRA adapters, the loss,
the checkpointing variants and the FLOP count.

The model: ``transformers.LlamaConfig`` with hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate
14336, vocab 128256 (``tiny=True``: 2 layers of width 64 for CPU tests), SDPA attention, built on the meta
device and materialised with ``to_empty`` on the target device, weights drawn there (normal, std 0.02), the
rotary table recomputed.  The loss is a chunked linear cross-entropy (`chunked_lm_loss`): the output head and the
loss run 4096 positions at a time and each chunk's gradient is formed in the forward, so the (seq, 128256) logits
never exist whole (what torchtune's chunked loss and Liger's fused linear cross-entropy do); every method uses it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=172, vocab_size=256, rope_theta=500000.0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_CHUNK = 4096  # positions per chunk of the output head + loss


def llama_config(tiny: bool, max_seq: int) -> Any:
    import transformers  # noqa: PLC0415

    return transformers.LlamaConfig(**(TINY if tiny else LLAMA3_8B), max_position_embeddings=max(max_seq, 8192),
                                    attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)


def build_llama(cfg: Any, device: torch.device, dtype: torch.dtype, seed: int = 0,
                shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """``LlamaForCausalLM(cfg)`` with random weights on ``device`` in ``dtype``: built on the meta device, then
    ``shard(model)`` if given (FSDP2's ``fully_shard`` per layer), ``to_empty``, weights drawn on the device."""
    import transformers  # noqa: PLC0415

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor shard: its local part
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen)
    old = model.model.rotary_emb  # its inv_freq is a buffer to_empty left undefined: computed anew on the device
    with torch.device(device):
        rope = type(old)(config=cfg)
    for name, buf in rope.named_buffers():
        setattr(old, name, buf)
    for name in ("original_inv_freq",):  # a plain attribute in some transformers versions
        if hasattr(rope, name) and not isinstance(getattr(type(rope), name, None), property):
            setattr(old, name, getattr(rope, name))
    model.train()
    return model


def add_lora(model: nn.Module, r: int = 16, seed: int = 1) -> nn.Module:
    """peft LoRA (rank ``r``, alpha 2r, no dropout) on q/k/v/o/gate/up/down; the base frozen.  Both adapter
    matrices are drawn at random (peft starts B at zero, which would make every A gradient zero)."""
    import peft  # noqa: PLC0415

    lm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                    target_modules=LORA_TARGETS))
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.02, generator=gen)
    return lm


class _ChunkedLinearCE(torch.autograd.Function):
    """Mean next-token cross-entropy of ``hidden @ weight.T`` over ``labels``, ``chunk`` rows at a time; the
    gradients (hidden's, and weight's when it requires grad) are formed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk: int) -> torch.Tensor:
        n = labels.numel()
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are upcast to float32
        total = torch.zeros((), device=hidden.device, dtype=acc)
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, n, chunk):
            h, y = hidden[s:s + chunk], labels[s:s + chunk]
            logits = (h @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if g_hidden is None and g_weight is None:
                continue
            g = torch.softmax(logits, dim=-1)
            g[torch.arange(len(y), device=y.device), y] -= 1.0
            g = (g / n).to(hidden.dtype)
            if g_hidden is not None:
                g_hidden[s:s + chunk] = g @ weight
            if g_weight is not None:
                g_weight += (g.t() @ h).to(acc)
        ctx.save_for_backward(*(t for t in (g_hidden, g_weight) if t is not None))
        ctx.has = (g_hidden is not None, g_weight is not None)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        g_hidden = saved.pop(0) if ctx.has[0] else None
        g_weight = saved.pop(0) if ctx.has[1] else None
        if g_hidden is not None:
            g_hidden = g_hidden * grad.to(g_hidden.dtype)
        if g_weight is not None:
            g_weight = (g_weight * grad).to(ctx.weight_dtype)
        return g_hidden, g_weight, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                    chunk: int = LOSS_CHUNK) -> torch.Tensor:
    """Next-token loss of ``hidden`` (B, S, H) under the output head ``weight`` (V, H) for token ids (B, S)."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = ids[:, 1:].reshape(-1)
    return _ChunkedLinearCE.apply(h, weight, y, chunk)


class CausalLMLoss(nn.Module):
    """``forward(ids) -> loss`` around a ``LlamaForCausalLM`` (``lm``): the decoder, then `chunked_lm_loss` with the
    model's own output head (the unit FSDP2 shards as its root; the module offloading attaches to)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=ids).last_hidden_state
        return chunked_lm_loss(hidden, self.lm.lm_head.weight, ids)  # FSDP2: the root's unsharded head here


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``LlamaForCausalLM`` inside ``model`` (a peft model or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ------------------------------------------------------------------------------------------ checkpointing
def selective_context_fn() -> Any:
    """torchtitan's op-level selective checkpointing: inside each layer, keep the outputs of attention and of
    every second matmul, recompute the rest (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: PLC0415

    aten = torch.ops.aten
    save = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten.max.default}
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == aten.mm.default:
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def set_checkpointing(model: nn.Module, mode: str | None) -> None:
    """Hugging Face activation checkpointing of each decoder layer (non-reentrant): ``"full"``, ``"selective"``
    (`selective_context_fn`), ``"offload"`` (full, the layer inputs it keeps in pinned host memory through
    ``save_on_cpu``, as Hugging Face's ``offload=True`` and torchtune's checkpointing + offloading do), or None
    (off)."""
    lm = causal_lm(model)
    if mode is None:
        fn = getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable
        fn()
        return
    kw: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kw["context_fn"] = selective_context_fn
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kw)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    if mode == "offload":
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

        pin = torch.cuda.is_available()

        def offloaded(function: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return checkpoint(function, *args, **kwargs)

        lm._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functools.partial(offloaded, **kw))


# ------------------------------------------------------------------------------------------ FLOPs
def model_flops_per_token(cfg: Any, seq: int, trainable_params: int, lora: bool) -> float:
    """Model FLOPs per token of one training step (recomputation not counted: MFU, not HFU).

    Dense part (PaLM's 6N, the embedding lookup excluded): full training 6 * N; LoRA 4 * N_base (forward 2N,
    backward 2N for the activation gradients; the frozen weights get no gradient) + 6 * N_lora.  Attention, causal
    (half the score matrix): 6 * layers * seq * hidden (forward 2 * seq * hidden per layer, backward twice that).
    """
    h, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * (2 * h + 2 * kv) + 3 * h * cfg.intermediate_size
    n_base = layers * per_layer + h * v  # decoder matmuls + output head
    dense = 4 * n_base + 6 * trainable_params if lora else 6 * n_base
    return float(dense + 6 * layers * seq * h)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the device (the vendor's figure), None when unknown."""
    name = device_name.lower()
    if "h200" in name or ("h100" in name and ("hbm3" in name or "sxm" in name)):
        return 989.4e12
    if "h100" in name and "nvl" in name:
        return 835e12
    if "h100" in name:
        return 756e12
    if "a100" in name:
        return 312e12
    return None


def lm_loss_fn(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> loss`` for a (peft-wrapped) causal LM: its decoder, then `chunked_lm_loss` with its frozen head."""
    lm = causal_lm(model)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        hidden = lm.model(input_ids=ids).last_hidden_state
        return chunked_lm_loss(hidden, lm.lm_head.weight, ids)

    return loss


__all__ = ["CausalLMLoss", "LLAMA3_8B", "TINY", "add_lora", "build_llama", "causal_lm", "chunked_lm_loss",
           "llama_config", "lm_loss_fn", "model_flops_per_token", "peak_flops", "selective_context_fn",
           "set_checkpointing"]
