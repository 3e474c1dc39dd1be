"""GPT-, BERT- and T5-style transformer stacks for ROK sweeps, and the `Workload` they make.

A `TransformerConfig` names a stack by family, hidden size, layers and sequence
length; `build_workload` turns it into a `Workload`: the model on a device, a
batch maker, its loss, its analytic model FLOPs and the layer lists that
layerwise recomputation wraps. The layers are written so that autograd saves
exactly the tensors `ssd_plan.activation_breakdown` counts (pre-LN, fused QKV,
`scaled_dot_product_attention`, GELU MLP, dropout on both residual branches).

A user's own model plugs in through `Workload` directly (see `rok.sweep`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.analysis.ssd_plan import PlanError, TransformerShape, model_flops_per_step

__all__ = ["PRESETS", "TransformerConfig", "TransformerLM", "Workload", "build_workload", "get_preset"]

_DEFAULT_VOCAB = {"gpt": 50257, "bert": 30522, "t5": 32128}


@dataclass(frozen=True)
class TransformerConfig:
    """A transformer stack: ``family`` in gpt (causal decoder), bert (bidirectional encoder),
    t5 (encoder + decoder with cross-attention; ``layers // 2`` decoder layers).

    ``heads`` defaults to ``hidden // 128`` (head dim 128, as in SSDTrain), at least 1;
    ``vocab`` defaults to the family's usual vocabulary.
    """

    family: str
    hidden: int
    layers: int
    seq: int
    heads: int | None = None
    vocab: int | None = None
    ffn_mult: int = 4
    dropout: float = 0.1
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in _DEFAULT_VOCAB:
            raise PlanError(f"family must be gpt, bert or t5, got {self.family!r}")
        for n in ("hidden", "layers", "seq", "ffn_mult"):
            if getattr(self, n) <= 0:
                raise PlanError(f"{n} must be positive, got {getattr(self, n)}")
        if self.hidden % self.n_heads:
            raise PlanError(f"hidden ({self.hidden}) must be a multiple of heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise PlanError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def n_vocab(self) -> int:
        return self.vocab or _DEFAULT_VOCAB[self.family]

    @property
    def label(self) -> str:
        return self.name or f"{self.family}-h{self.hidden}-l{self.layers}-s{self.seq}"

    def shape(self, micro_batch: int, dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str = "cuda", recompute_elementwise: bool = False) -> TransformerShape:
        """The `ssd_plan.TransformerShape` of this stack at ``micro_batch`` (embedding and head included).

        ``device`` sets the dropout-mask element size: CUDA's fused dropout keeps a
        bool mask, the CPU one a mask of the activation dtype.  ``recompute_elementwise``:
        count what datapath's offloader stores (GELU outputs recomputed), not what autograd saves.
        """
        p = torch.empty((), dtype=dtype).element_size()
        return TransformerShape(
            layers=self.layers, hidden=self.hidden, heads=self.n_heads, seq=self.seq,
            micro_batch=micro_batch, family=self.family, ffn_hidden=self.ffn_mult * self.hidden,
            vocab=self.n_vocab, dtype_bytes=p, dropout=self.dropout > 0, flash_attention=True,
            mask_bytes=1 if torch.device(device).type == "cuda" else p,
            recompute_elementwise=recompute_elementwise,
        )

    def flops_per_step(self, micro_batch: int) -> float:
        """Algorithmic training FLOPs of one step (3 x forward, recomputation not counted)."""
        return model_flops_per_step(self.shape(micro_batch))

    def replace(self, **changes: Any) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


def _p(family: str, hidden: int, layers: int, seq: int, **kw: Any) -> TransformerConfig:
    return TransformerConfig(family, hidden, layers, seq, name=f"{family}-h{hidden}-l{layers}", **kw)


PRESETS: dict[str, TransformerConfig] = {
    # tiny: CPU tests and CI
    "bert-tiny": TransformerConfig("bert", 64, 2, 32, heads=4, vocab=512, name="bert-tiny"),
    "gpt-tiny": TransformerConfig("gpt", 64, 2, 32, heads=4, vocab=512, name="gpt-tiny"),
    "t5-tiny": TransformerConfig("t5", 64, 4, 32, heads=4, vocab=512, name="t5-tiny"),
    "bert-small": TransformerConfig("bert", 512, 4, 256, heads=8, name="bert-small"),
    # SSDTrain's configurations (seq 1024, head dim 128)
    "bert-h8192-l4": _p("bert", 8192, 4, 1024),
    "bert-h12288-l3": _p("bert", 12288, 3, 1024),
    "bert-h14336-l3": _p("bert", 14336, 3, 1024),
    "bert-h16384-l2": _p("bert", 16384, 2, 1024),
    # scaled to one H200: its compute outruns PCIe 5 by more than the A100 outran its SSDs, and the
    # bandwidth offloading needs falls as 1/hidden (ssd-plan), so the hidden size grows instead
    "bert-h16384-l3": _p("bert", 16384, 3, 1024),
    "bert-h20480-l3": _p("bert", 20480, 3, 1024),
    "gpt-h8192-l4": _p("gpt", 8192, 4, 1024),
    "gpt-h12288-l3": _p("gpt", 12288, 3, 1024),
    "gpt-h16384-l2": _p("gpt", 16384, 2, 1024),
    "t5-h8192-l4": _p("t5", 8192, 4, 1024),
    "t5-h12288-l3": _p("t5", 12288, 3, 1024),
    "t5-h16384-l2": _p("t5", 16384, 2, 1024),
}


def get_preset(name: str, **overrides: Any) -> TransformerConfig:
    """A preset by name, or a spec ``family:h=H,l=L,s=S[,a=heads][,v=vocab]``; ``overrides``
    (hidden=, layers=, seq=, heads=, vocab=, dropout=) replace fields (None ones are ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name in PRESETS:
        cfg = PRESETS[name]
    else:
        m = re.fullmatch(r"(gpt|bert|t5):(.*)", name)
        if not m:
            raise PlanError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}, "
                            "or a spec like 'bert:h=1024,l=4,s=512'")
        keys = {"h": "hidden", "l": "layers", "s": "seq", "a": "heads", "v": "vocab"}
        kw: dict[str, int] = {}
        for item in filter(None, m.group(2).split(",")):
            k, _, v = item.partition("=")
            if k not in keys or not v.isdigit():
                raise PlanError(f"bad preset spec item {item!r} in {name!r}; use h=, l=, s=, a=, v=")
            kw[keys[k]] = int(v)
        missing = {"hidden", "layers", "seq"} - kw.keys()
        if missing:
            raise PlanError(f"preset spec {name!r} lacks {sorted(missing)}")
        cfg = TransformerConfig(m.group(1), **kw)
    if overrides:
        cfg = cfg.replace(**overrides)
        if {"hidden", "layers", "seq"} & overrides.keys():
            cfg = cfg.replace(name="")
    return cfg


class _Attention(nn.Module):
    """Multi-head attention with a fused QKV projection (or Q + fused KV for cross-attention)."""

    def __init__(self, hidden: int, heads: int, *, cross: bool) -> None:
        super().__init__()
        self.heads, self.cross = heads, cross
        if cross:
            self.q = nn.Linear(hidden, hidden)
            self.kv = nn.Linear(hidden, 2 * hidden)
        else:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        if self.cross:
            assert memory is not None
            q = self.q(x)
            k, v = self.kv(memory).split(h, dim=-1)
        else:
            q, k, v = self.qkv(x).split(h, dim=-1)
        # (b, s, heads, d) viewed as (b, heads, s, d): views of one storage; the output comes back
        # laid out as (b, s, heads, d), so the reshape below is a view too.
        q, k, v = (t.unflatten(-1, (self.heads, d)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(o.transpose(1, 2).reshape(b, s, h))


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    """Pre-LN transformer layer; with ``cross`` a cross-attention block over ``memory``."""

    def __init__(self, cfg: TransformerConfig, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        h = cfg.hidden
        self.causal = causal
        self.ln1 = nn.LayerNorm(h)
        self.attn = _Attention(h, cfg.n_heads, cross=False)
        self.ln_x = nn.LayerNorm(h) if cross else None
        self.xattn = _Attention(h, cfg.n_heads, cross=True) if cross else None
        self.ln2 = nn.LayerNorm(h)
        self.mlp = _MLP(h, cfg.ffn_mult * h)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), causal=self.causal))
        if self.xattn is not None:
            assert self.ln_x is not None
            x = x + self.drop(self.xattn(self.ln_x(x), memory))
        return x + self.drop(self.mlp(self.ln2(x)))


class TransformerLM(nn.Module):
    """A GPT/BERT/T5-style language model whose ``forward(tokens)`` returns the mean token loss.

    tokens: (b, s) int64 on the model's device. GPT predicts the next token, BERT
    and T5 reconstruct their input tokens (a masked-LM-shaped loss over all
    positions; T5's decoder reads the same tokens). Weights are random.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, v = cfg.hidden, cfg.n_vocab
        self.tok = nn.Embedding(v, h)
        self.pos = nn.Embedding(cfg.seq, h)
        self.emb_ln = nn.LayerNorm(h) if cfg.family == "bert" else None
        self.drop = nn.Dropout(cfg.dropout)
        n_dec = cfg.layers // 2 if cfg.family == "t5" else 0
        self.layers = nn.ModuleList(
            _Layer(cfg, causal=cfg.family == "gpt") for _ in range(cfg.layers - n_dec)
        )
        self.decoder_layers = nn.ModuleList(_Layer(cfg, causal=True, cross=True) for _ in range(n_dec))
        self.enc_ln = nn.LayerNorm(h) if n_dec else None
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, v, bias=False)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        if self.emb_ln is not None:
            x = self.emb_ln(x)
        return self.drop(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer(x)
        if self.enc_ln is not None:  # T5: encoder output feeds every decoder layer
            memory = self.enc_ln(x)
            x = self._embed(tokens)
            for layer in self.decoder_layers:
                x = layer(x, memory)
        logits = self.head(self.ln_f(x))
        # GPT: next token (the last position wraps to the first); BERT/T5: the input tokens.
        target = tokens.roll(-1, dims=1) if self.cfg.family == "gpt" else tokens
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass
class Workload:
    """What a ROK sweep runs: a model and how to feed it.

    - ``model``: on its device, in training mode;
    - ``make_batch(micro_batch)`` -> tuple of positional inputs (on the model's device);
    - ``loss_fn(model, batch)`` -> scalar loss tensor (default: ``model(*batch)``; a
      non-scalar output is averaged; an object with ``.loss`` gives that);
    - ``flops_per_step(micro_batch)`` -> algorithmic FLOPs of one training step, or
      None to measure (3 x forward FLOPs counted by `torch.utils.flop_counter`);
    - ``layer_lists``: the `nn.ModuleList`s whose members layerwise recomputation
      wraps (None: the largest ModuleList in the model);
    - ``activation_estimate(micro_batch)`` -> bytes, optional (the ssd-plan estimate of what autograd saves).
    - ``stored_estimate(micro_batch, recompute_elementwise)`` -> bytes, optional: what an offloader storing
      everything stores (less the GELU outputs it recomputes when ``recompute_elementwise``).
    """

    model: nn.Module
    make_batch: Callable[[int], tuple[Any, ...]]
    loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor] | None = None
    flops_per_step: Callable[[int], float] | None = None
    layer_lists: Sequence[nn.ModuleList] | None = None
    activation_estimate: Callable[[int], float] | None = None
    stored_estimate: Callable[[int, bool], float] | None = None
    name: str = "custom"
    info: dict[str, Any] = field(default_factory=dict)


def build_workload(cfg: TransformerConfig, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> Workload:
    """Build ``cfg``'s model (random weights, ``dtype``) on ``device`` as a `Workload`."""
    from datapath.analysis.ssd_plan import activation_breakdown

    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device("meta"):  # no memory until to_empty; then fill in place on the device
        model = TransformerLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():  # seeded random init on the device
        dev_gen = torch.Generator(device=device).manual_seed(seed) if device.type == "cuda" else gen
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # LayerNorm weight
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=dev_gen)
    model.train()

    def make_batch(micro_batch: int) -> tuple[torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(seed + micro_batch)
        tokens = torch.randint(0, cfg.n_vocab, (micro_batch, cfg.seq), generator=g)
        return (tokens.to(device),)

    lists = [model.layers] + ([model.decoder_layers] if len(model.decoder_layers) else [])
    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=None,
        flops_per_step=cfg.flops_per_step,
        layer_lists=lists,
        activation_estimate=lambda mb: float(activation_breakdown(cfg.shape(mb, dtype, device))["total"]),
        stored_estimate=lambda mb, rec: float(activation_breakdown(cfg.shape(mb, dtype, device, rec))["total"]),
        name=cfg.label,
        info={**dataclasses.asdict(cfg), "heads": cfg.n_heads, "vocab": cfg.n_vocab,
              "dtype": str(dtype).replace("torch.", ""),
              "parameters": sum(p.numel() for p in model.parameters())},
    )
