"""Small models and a step runner shared by the offload tests (CPU and GPU)."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from datapath.offload import BudgetProfile


class GPTBlock(nn.Module):
    """Pre-LN decoder block; q, k, v are views of one fused qkv projection."""

    def __init__(self, h: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # non-contiguous views of the qkv storage
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # saves the three views
        x = x + self.drop(self.proj(o.transpose(1, 2).reshape(b, s, h)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Embedding, GPT blocks in a ModuleList, final norm, LM head tied to the embedding."""

    def __init__(self, vocab: int = 96, h: int = 32, heads: int = 4, layers: int = 3, dropout: float = 0.1,
                 tied: bool = True, use_checkpoint: str | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(GPTBlock(h, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.use_checkpoint = use_checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for blk in self.blocks:
            if self.use_checkpoint is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.use_checkpoint == "reentrant")
        return self.head(self.ln(x))


def mlp(width: int = 64, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def run_steps(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
              ctx: Any = None, between: Callable[[], None] | None = None, seed0: int = 1000
              ) -> list[tuple[torch.Tensor, list[torch.Tensor | None]]]:
    """Train-like steps (seeded per step for dropout): per step the loss and every parameter's grad."""
    out = []
    for i, batch in enumerate(batches):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(seed0 + i)
        if ctx is not None:
            with ctx:
                loss = loss_fn(model, batch)
                if between is not None:
                    between()
                loss.backward()
        else:
            loss = loss_fn(model, batch)
            loss.backward()
        out.append((loss.detach().clone(), [None if p.grad is None else p.grad.clone()
                                             for p in model.parameters()]))
        with torch.no_grad():  # change the weights like an optimizer would
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(1e-2 * p.grad)
    return out


def cpu_keep_peak(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> int:
    """The CPU memory meter's peak of one training step of a copy of ``model`` with nothing offloaded (bytes,
    parameters included): what a budget is a fraction of in the CPU budget tests."""
    import copy  # noqa: PLC0415

    from datapath.offload.memory_meter import CpuMeter  # noqa: PLC0415
    m = copy.deepcopy(model)
    meter = CpuMeter(sum(p.numel() * p.element_size() for p in m.parameters()))
    meter.lap()
    with meter:
        loss_fn(m, batch).backward()
    return meter.lap()


def cpu_hf_checkpoint_peak(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> int:
    """`cpu_keep_peak` of a copy of the Hugging Face ``model`` with its own gradient checkpointing on
    (non-reentrant): the budget a user sets to match checkpointing."""
    import copy  # noqa: PLC0415

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return cpu_keep_peak(hf, loss_fn, batch)


def assert_identical(ref: list[Any], got: list[Any]) -> None:
    assert len(ref) == len(got)
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(ref, got)):
        assert torch.equal(l0, l1), f"step {step}: loss {l0.item()} != {l1.item()}"
        assert len(g0) == len(g1)
        for k, (a, b) in enumerate(zip(g0, g1)):
            assert (a is None) == (b is None), f"step {step}: grad {k} presence differs"
            if a is not None:
                assert torch.equal(a, b), f"step {step}: grad {k} differs (max {(a - b).abs().max().item()})"


def layered_profile(layers: int, bandwidth: float) -> BudgetProfile:
    """A synthetic budget profile: per layer a unit (8 MB saved, 10 ms) and the code after it (nothing saved);
    every layer recomputable, ``bandwidth`` bytes/s both ways."""
    from datapath.offload import BudgetProfile, SegmentCost

    segs = [SegmentCost(False, -1, 0.0, 100, None)]
    storages = []
    mb = 8 << 20
    for b in range(layers):
        segs.append(SegmentCost(True, b, 0.010, 100 + mb, 100 + mb))
        storages.append((len(segs) - 1, mb))
        segs.append(SegmentCost(False, b, 0.0, 100, None))
    return BudgetProfile(segs, storages, 100 + mb, {b: 1 << 20 for b in range(layers)}, bandwidth, bandwidth,
                         recomputable=list(range(layers)))


def hf_llama(layers: int = 3, h: int = 32, heads: int = 2, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A small Hugging Face Llama (SDPA attention, vocabulary 96) in training mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=2 * h + 8, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                   vocab_size=96, max_position_embeddings=4096, attention_dropout=dropout,
                                   attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def lm_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's loss on ``ids`` (labels = inputs)."""
    return m(input_ids=ids, labels=ids).loss


@dataclass
class LongContext:
    """A small HF Llama at a long sequence (2048 tokens, width 64) and its reference: ``batches`` ([1, 2048] ids),
    ``ref`` (plain steps' losses and gradients), ``params`` / ``keep`` / ``ckpt`` (bytes: parameters, the peak
    keeping everything, Hugging Face checkpointing's peak, as the CPU meter counts them)."""

    model: nn.Module
    batches: list[torch.Tensor]
    ref: list[Any]
    params: int
    keep: int
    ckpt: int

    def train_under(self, budget: int, host_share: float) -> tuple[Any, list[Any]]:
        """Every step under ``memory_budget=budget`` with a host store of ``host_share`` of the activations keeping
        everything holds; gradients checked bit-identical to ``ref``.  The (still open) cache and the steps."""
        from datapath.offload import TensorCache

        cache = TensorCache("host", memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True,
                            host_budget_bytes=int(host_share * (self.keep - self.params)))
        cache.attach(self.model)
        got = run_steps(self.model, self.batches, lm_loss, ctx=cache)
        assert_identical(self.ref, got)
        return cache, got


def long_context(layers: int, steps: int) -> LongContext:
    model = hf_llama(layers=layers, h=64, heads=4, seed=5)
    batches = [torch.randint(0, 96, (1, 2048), generator=torch.Generator().manual_seed(10 + i)) for i in range(steps)]
    ref = run_steps(copy.deepcopy(model), batches, lm_loss)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return LongContext(model, batches, ref, params, cpu_keep_peak(model, lm_loss, batches[0]),
                       cpu_hf_checkpoint_peak(model, lm_loss, batches[0]))


class CountSdpa(TorchDispatchMode):
    """Counts the fused attention ops run while active (a backward's recomputations included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from datapath.offload.attention_saved import SDPA_OPS

        if func in SDPA_OPS:
            self.calls += 1
        return func(*args, **(kwargs or {}))
