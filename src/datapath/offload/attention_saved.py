"""Recomputing a block but keeping its attention outputs (selective activation checkpointing).

A block recomputed with ``attention_saved`` runs under non-reentrant checkpointing
with PyTorch's selective-checkpoint contexts (`create_selective_checkpoint_contexts`):
the outputs of its scaled-dot-product-attention ops (flash, memory-efficient, cuDNN,
the CPU flash kernel: the attention output and its log-sum-exp; not a call with dropout,
see `draws_random`) are saved in the forward, every other op is recomputed in the backward, and the recomputation reuses
the saved attention outputs instead of running the attention forward again.  The
saved outputs are the very tensors the first forward made, so the gradients are
bit-identical to plain recomputation.  At long context the attention forward is a
large share of a block (its cost grows with the square of the sequence), and the
saved bytes (per block: the attention output, the size of its input, plus the
log-sum-exp) are small beside the block's other activations.

The saved outputs are held by the checkpoint (the selective-checkpoint dispatch
mode's storage), not passed through saved-tensor hooks: they stay on the device
from the block's forward to its backward, and the memory model counts them there
(`datapath.offload.budget_planner`).

What the planner needs is measured, not guessed: while a profiled step recomputes
blocks, each recomputed block's forward runs under an `AttentionProbe` (a dispatch
mode that times the attention ops and adds up their outputs' bytes; the recomputation
runs as plain checkpointing), and `AttentionCosts` keeps, per block, the bytes
saving would hold and the seconds it would save.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SDPA_OP_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""The aten attention ops whose outputs ``attention_saved`` keeps (those this torch has)."""

DISPATCH_S = 2e-5
"""Seconds of Python dispatch one op costs under the selective-checkpoint mode (its forward and its recompute
each pass every op of the block through it): subtracted from the attention time a block saves."""

_PROBE = "_datapath_attention_probe"


def _sdpa_ops() -> frozenset[Any]:
    out = []
    for name in SDPA_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            out.append(packet.default)
    return frozenset(out)


SDPA_OPS = _sdpa_ops()


def draws_random(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of an attention op applies dropout: it draws from the RNG, and a recomputation that
    skipped it would leave the generator behind, so every later random op of the block (a residual dropout)
    would draw other numbers than in the forward.  Such calls are neither saved nor counted: they run again."""
    try:
        names = [a.name for a in op._schema.arguments]
    except AttributeError:
        return False
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
    return bool(p and float(p) > 0.0)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    save = op in SDPA_OPS and not draws_random(op, args, kwargs)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def attention_saved_contexts() -> tuple[Any, Any]:
    """``context_fn`` for `torch.utils.checkpoint.checkpoint`: save the attention ops' outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_policy)


def _compiled_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if not torch.compiler.is_compiling():
        # the region runs eagerly (TorchDynamo fell back to Python: a graph break, the compiler disabled): the
        # eager policy, whose recomputation draws every random op again in order from the replayed RNG state
        return _policy(ctx, op, *args, **kwargs)
    seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    return CheckpointPolicy.MUST_SAVE if op in SDPA_OPS or seeded else CheckpointPolicy.MUST_RECOMPUTE


def compiled_attention_saved_contexts() -> tuple[Any, Any]:
    """`attention_saved_contexts` for a checkpoint inside a compiled region: there ``PREFER_RECOMPUTE`` leaves the
    compiler's partitioner free to save what it likes, so every other op is ``MUST_RECOMPUTE``, except the ops that
    draw from the RNG (dropout, an attention op with dropout): inside a compiled region a recomputed draw is not
    the forward's (on the GPU, Inductor's generator moves on), so their outputs are saved and never drawn again.
    Where the region runs eagerly after all (TorchDynamo's fallback), the eager policy applies."""
    return create_selective_checkpoint_contexts(_compiled_policy)


class AttentionCosts:
    """Per block, what its attention ops cost in the last probed forward: ``saved_bytes`` (device bytes of their
    outputs) and ``seconds`` (their forward time), and ``ops`` (every op the block dispatched)."""

    def __init__(self) -> None:
        self.saved_bytes: dict[int, int] = {}
        self.ops: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self._times: dict[int, list[Any]] = {}   # block -> [(start, end)] events (CUDA) or seconds (CPU)

    def begin(self, block: int) -> None:
        """A probed forward of ``block`` starts: its earlier measures are replaced."""
        self.saved_bytes[block] = 0
        self.ops[block] = 0
        self.calls[block] = 0
        self._times[block] = []

    def seconds(self, block: int) -> float:
        """The forward time of ``block``'s attention ops (synchronizes with their events on CUDA)."""
        total = 0.0
        for t in self._times.get(block, []):
            if isinstance(t, float):
                total += t
            else:
                start, end = t
                end.synchronize()
                total += start.elapsed_time(end) / 1e3
        return total

    def gains(self) -> dict[int, tuple[int, float]]:
        """block -> (bytes saving its attention outputs holds, seconds it saves per step): the attention
        forward time less the selective mode's dispatch cost (`DISPATCH_S` per op, forward and recompute)."""
        out = {}
        for b, nb in self.saved_bytes.items():
            if self.calls.get(b):
                out[b] = (nb, self.seconds(b) - 2 * DISPATCH_S * self.ops.get(b, 0))
        return out

    def attach(self, blocks: Sequence[nn.Module], skip: Callable[[nn.Module], bool] = lambda block: False) -> None:
        """Probe the blocks' forwards while they are recomputed (until `detach`), but those ``skip`` names:
        the caller passes `datapath.offload.regional_compile.is_compiled`, since a dispatch mode around a
        compiled region would run it eagerly, and what such a block saves is the compiler's choice."""
        for i, block in enumerate(blocks):
            if not skip(block):
                block.__dict__[_PROBE] = (self, i)

    @staticmethod
    def detach(blocks: Iterable[nn.Module]) -> None:
        for block in blocks:
            block.__dict__.pop(_PROBE, None)


def probe_of(block: nn.Module) -> tuple[AttentionCosts, int] | None:
    """The costs a recomputed ``block``'s forward is probed into, and its index (None: not probed)."""
    return block.__dict__.get(_PROBE)


class AttentionProbe(TorchDispatchMode):
    """A block's forward under plain recomputation: every op runs as it would; the attention ops are timed
    (CUDA events on the current stream, or wall time on the CPU) and their outputs' bytes on the device of
    their query are added up into ``costs`` for ``block``."""

    def __init__(self, costs: AttentionCosts, block: int) -> None:
        super().__init__()
        self.costs = costs
        self.block = block
        costs.begin(block)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        c = self.costs
        c.ops[self.block] = c.ops.get(self.block, 0) + 1
        if func not in SDPA_OPS or draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        q = args[0]
        if q.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            c._times[self.block].append((start, end))
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            c._times[self.block].append(time.perf_counter() - t0)
        c.calls[self.block] += 1
        c.saved_bytes[self.block] += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                                         if isinstance(t, torch.Tensor) and t.device == q.device)
        return out


def probe_contexts(costs: AttentionCosts, block: int) -> tuple[Any, Any]:
    """``context_fn`` of a probed recomputed block: the forward under an `AttentionProbe`, the recompute plain."""
    return AttentionProbe(costs, block), contextlib.nullcontext()
