"""Selective recompute of cheap modules: save their input, run them again in backward.

Some modules are a few elementwise kernels that save several tensors of their
input's size: GPT-2's tanh GELU (``NewGELUActivation``) saves four, a Hugging Face
RMSNorm on bf16 input an fp32 copy of it and a bf16 product.  Offloading them moves
those bytes over PCIe twice per step; recomputing them costs a few elementwise
kernels.  `set_cheap_recompute` puts such modules under `_Recompute`: the forward
runs without recording a graph and saves only the module's input (which the
offloader then stores like any other saved tensor); the backward runs the module
again on that input, under the autocast state of the forward, and differentiates it.
The recomputed kernels are the forward's own, so outputs and gradients are bit for
bit those of the module run normally.  These modules draw no random numbers.

Used only in eager mode: while `torch.compile` traces a model the module runs as it
is (the compiler makes its own recompute decisions).  Modules changing their input
in place, called with more than one tensor or with keyword arguments, run as they are.
An RMSNorm on float32 input runs as it is too: its input then has several uses inside the
module, and the sum of their gradients with the input's other uses could round differently.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ORIGINAL = "_datapath_cheap_original"

# multi-kernel activations of transformers.activations (the single-kernel ones save only their input already)
ACTIVATIONS = frozenset({"NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "MishActivation",
                         "ReLUSquaredActivation"})


def is_cheap(module: nn.Module) -> bool:
    """Whether ``module`` is a multi-kernel activation or a Hugging Face RMSNorm (see the module docstring)."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return False
    if getattr(module, "inplace", False):
        return False
    if cls.__name__ in ACTIVATIONS:
        return not any(True for _ in module.parameters(recurse=False))
    return cls.__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)


class _Recompute(torch.autograd.Function):
    """``fn(x)`` saving only ``x``; the parameters are inputs so that their gradients reach them."""

    @staticmethod
    def forward(ctx: Any, fn: Any, autocast: tuple[str, bool, torch.dtype, bool], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.autocast, ctx.params = fn, autocast, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        device, enabled, dtype, cache = ctx.autocast
        needs = ctx.needs_input_grad[3:]
        wrt_x = ctx.needs_input_grad[2]
        xd = x.detach().requires_grad_(wrt_x)
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache):
            out = ctx.fn(xd)
        inputs = ([xd] if wrt_x else []) + [p for p, need in zip(ctx.params, needs) if need]
        grads = list(torch.autograd.grad(out, inputs, grad, allow_unused=True)) if inputs else []
        gx = grads.pop(0) if wrt_x else None
        gp = [grads.pop(0) if need else None for need in needs]
        return (None, None, gx, *gp)


def _autocast_state(device: str) -> tuple[str, bool, torch.dtype, bool]:
    return (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.is_autocast_cache_enabled())


def _wrap(module: nn.Module, original: Any) -> Any:
    params = list(module.parameters(recurse=False))
    rmsnorm = type(module).__name__.endswith("RMSNorm")

    def forward(*args: Any, **kwargs: Any) -> Any:
        if (kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled()
                or torch.compiler.is_compiling() or (rmsnorm and args[0].dtype == torch.float32)):
            return original(*args, **kwargs)
        x = args[0]
        if not (x.requires_grad or any(p.requires_grad for p in params)):
            return original(x)
        return _Recompute.apply(original, _autocast_state(x.device.type), x, *params)
    return forward


def set_cheap_recompute(model: nn.Module, on: bool) -> int:
    """Put every cheap module of ``model`` under recompute (``on``) or restore it; the number switched."""
    n = 0
    for m in model.modules():
        wrapped = _ORIGINAL in m.__dict__
        if on and not wrapped and is_cheap(m):
            had_own = "forward" in m.__dict__
            original = m.forward
            m.__dict__[_ORIGINAL] = (original, had_own)
            m.forward = _wrap(m, original)  # type: ignore[method-assign]
            n += 1
        elif not on and wrapped:
            original, had_own = m.__dict__.pop(_ORIGINAL)
            if had_own:
                m.forward = original  # type: ignore[method-assign]
            else:
                del m.forward
            n += 1
    return n
