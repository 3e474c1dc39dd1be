"""Elementwise outputs recomputed from saved inputs (GELU, SiLU, products): gradients bit-identical to the model
run without offloading, those outputs never stored, in-place changes caught, the switch honoured."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _offload_models import assert_identical, run_steps
from datapath.offload import TensorCache


class GeluMLP(nn.Module):
    """Pre-LN GELU MLPs with residuals (the B4 GPT stack's MLP), functional GELU."""

    def __init__(self, h: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.ln = nn.ModuleList(nn.LayerNorm(h) for _ in range(layers))
        self.fc1 = nn.ModuleList(nn.Linear(h, 4 * h) for _ in range(layers))
        self.fc2 = nn.ModuleList(nn.Linear(4 * h, h) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for ln, fc1, fc2 in zip(self.ln, self.fc1, self.fc2):
            x = x + fc2(F.gelu(fc1(ln(x)), approximate="tanh"))
        return x


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), with residuals."""

    def __init__(self, h: int = 64, inter: int = 176, layers: int = 3) -> None:
        super().__init__()
        self.gate = nn.ModuleList(nn.Linear(h, inter, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(h, inter, bias=False) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(inter, h, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for g, u, d in zip(self.gate, self.up, self.down):
            x = x + d(F.silu(g(x)) * u(x))
        return x


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().square().mean()


def _cache(**kw) -> TensorCache:
    return TensorCache("host", min_bytes=1024, offload_cpu_tensors=True, **kw)


@pytest.mark.parametrize("family, per_layer", [("gelu", 1), ("swiglu", 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_outputs_give_identical_gradients(family: str, per_layer: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = (GeluMLP() if family == "gelu" else SwiGLU()).to(dtype)
    batches = [torch.randn(4, 32, 64, dtype=dtype) for _ in range(3)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    cache = _cache()
    got = run_steps(model, batches, _loss, ctx=cache)
    assert_identical(ref, got)
    # per layer and step: the GELU output (4 x 32 x 256), or SiLU's output and the product (4 x 32 x 176 each)
    inter = 4 * 64 if family == "gelu" else 176
    want = 3 * len(batches) * per_layer * 4 * 32 * inter * torch.empty(0, dtype=dtype).element_size()
    assert cache.stats.bytes_recomputed_ops == want
    cache.close()


def test_recomputed_outputs_are_not_stored() -> None:
    torch.manual_seed(1)
    model = GeluMLP()
    x = torch.randn(4, 32, 64)
    saved = {}
    for on in (True, False):
        cache = TensorCache("host", min_bytes=1 << 30, offload_cpu_tensors=True, recompute_elementwise=on)
        with cache:  # everything below min_bytes: kept, and counted
            _loss(model, x).backward()
        saved[on] = cache.stats.bytes_kept_small
        assert (cache.stats.bytes_recomputed_ops > 0) == on
        cache.close()
    gelu_out = 3 * 4 * 32 * 256 * 4
    assert saved[False] - saved[True] == gelu_out, saved


def test_an_input_changed_in_place_is_caught() -> None:
    fc1, fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
    x = torch.randn(8, 64)
    cache = _cache()
    with cache, pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h = fc1(x)
        y = fc2(F.gelu(h))
        with torch.no_grad():
            h.mul_(2)  # after GELU saved it (and fc2 saved GELU's output)
        y.sum().backward()
    cache.close()


def test_recompute_survives_a_kept_and_an_offloaded_input() -> None:
    """The inputs a recipe needs may be kept (small, or the policy's) or offloaded: both give the same bits."""
    torch.manual_seed(3)
    model = SwiGLU(h=32, inter=48, layers=2)
    batches = [torch.randn(2, 16, 32) for _ in range(2)]
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    for min_bytes in (1 << 30, 1024):  # everything kept; everything offloaded
        cache = TensorCache("host", min_bytes=min_bytes, offload_cpu_tensors=True)
        assert_identical(ref, run_steps(copy.deepcopy(model), batches, _loss, ctx=cache))
        assert cache.stats.bytes_recomputed_ops > 0
        cache.close()
