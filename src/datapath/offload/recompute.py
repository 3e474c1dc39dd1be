"""Recomputing whole blocks: non-reentrant `torch.utils.checkpoint` put around a block's forward in place.

The block's ``forward`` is replaced on the instance (the module tree, parameter
names and state dict stay as they are) by one that runs the original under
``checkpoint(..., use_reentrant=False)``: its activations are not saved, its input
is held by the checkpoint, and in backward the forward runs again with the CPU
and CUDA RNG states it first ran with (``preserve_rng_state``), so dropout draws
the same masks and gradients stay bit-identical.  As with Hugging Face's own
checkpointing, a recomputed block runs without a KV cache.  `set_recompute`
switches blocks on and off between steps; its ``partitioned`` blocks (compiled ones) run their compiled
region partitioned under a memory budget instead (`datapath.offload.regional_compile`: no checkpoint, the
compiler chooses what is saved and recomputed); its ``attention_saved`` blocks keep their attention
outputs (`datapath.offload.attention_saved`: the attention forward is not run again in the backward; a block
compiled by `datapath.offload.regional_compile` runs its compiled region with the checkpoint inside it instead),
its ``attention_offloaded`` blocks keep them in the offload store
(`datapath.offload.attention_offload`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from datapath.offload.attention_offload import AttentionStore
from datapath.offload.attention_saved import attention_saved_contexts, probe_contexts, probe_of
from datapath.offload.errors import OffloadConfigError

_ORIGINAL = "_datapath_recompute_original"
_KEEP_ATTENTION = "_datapath_recompute_attention_saved"
_OFFLOAD_ATTENTION = "_datapath_recompute_attention_offloaded"
_PARTITION = "_datapath_recompute_partitioned"
COMPILED_PARTITIONED = "_datapath_compiled_partitioned"
"""Where `datapath.offload.regional_compile` puts a compiled block's forward compiled under the partitioner's
activation memory budget (what ``partitioned`` runs)."""
COMPILED_SAVING_ATTENTION = "_datapath_compiled_attention_saved"
"""Where `datapath.offload.regional_compile` puts a compiled block's other compiled forward: the block under
checkpointing that keeps its attention outputs, compiled as one region (what ``attention_saved`` runs)."""


def already_recomputed(block: nn.Module) -> bool:
    """True when ``block`` recomputes itself already (Hugging Face gradient checkpointing is on)."""
    return bool(getattr(block, "gradient_checkpointing", False)) and block.training


def is_recomputed(block: nn.Module) -> bool:
    """True when datapath put ``block`` under recomputation."""
    return _ORIGINAL in block.__dict__


_CACHES = ("past_key_value", "past_key_values", "layer_past", "cache")
"""The names Hugging Face blocks take their KV cache by (``cache`` since transformers 5.2x)."""


def _is_kv_cache(value: Any) -> bool:
    """A Hugging Face KV cache (`transformers.Cache` or a subclass), told apart without importing transformers."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def without_kv_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block call's arguments with its Hugging Face KV cache dropped (as Hugging Face's own checkpointing
    does): a cache passed by keyword or by position (GPT-2 passes it second) becomes None, ``use_cache`` False."""
    if any(_is_kv_cache(a) for a in args):
        args = tuple(None if _is_kv_cache(a) else a for a in args)
    for name, value in kwargs.items():
        if value is not None and (name in _CACHES or _is_kv_cache(value)):
            kwargs[name] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "attn_pdrop")
"""Float attributes by which attention modules hold their dropout probability (Hugging Face's attention classes,
`torch.nn.MultiheadAttention`)."""


def draws_dropout(block: nn.Module) -> bool:
    """Whether ``block`` in training mode applies dropout: an ``nn.Dropout`` of p > 0 inside it, or a module holding
    a dropout probability > 0 as a float attribute (an attention module passing it to its attention op)."""
    if not block.training:
        return False
    for m in block.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name in _DROPOUT_ATTRIBUTES:
            v = m.__dict__.get(name)
            if isinstance(v, float) and v > 0:
                return True
    return False


def _compiled_dropout_error(which: str) -> OffloadConfigError:
    """The refusal of compiled blocks with dropout (``which``: "blocks [..] are") keeping their attention outputs
    in their compiled region."""
    return OffloadConfigError(
        f"{which} compiled with dropout on: a compiled block cannot keep its attention outputs inside its compiled "
        f"region (the recomputation there cannot replay the forward's masks, and on the GPU torch's partitioner "
        f"rejects saving them). Recompute it without attention_saved, set its dropout to 0, or leave it "
        f"uncompiled: an eager block keeps its attention outputs with the forward's masks")


def _partitioned_dropout_error(which: str) -> OffloadConfigError:
    """The refusal of partitioned blocks (``which``: "blocks [..] are") with dropout on."""
    return OffloadConfigError(
        f"{which} partitioned with dropout on: under a memory budget torch's partitioner may recompute a dropout in "
        f"the backward with a new mask (PyTorch issue 190758), silently wrong gradients. Recompute it without "
        f"partitioned, or set its dropout to 0")


def keeps_attention(block: nn.Module) -> bool:
    """True when ``block`` is recomputed with its attention outputs saved."""
    return is_recomputed(block) and bool(block.__dict__.get(_KEEP_ATTENTION))


def is_partitioned(block: nn.Module) -> bool:
    """True when ``block`` is recomputed by its compiled region's partitioner."""
    return is_recomputed(block) and bool(block.__dict__.get(_PARTITION))


def offloads_attention(block: nn.Module) -> bool:
    """True when ``block`` is recomputed with its attention outputs offloaded."""
    return is_recomputed(block) and block.__dict__.get(_OFFLOAD_ATTENTION) is not None


def _context_fn(block: nn.Module) -> Any:
    """The checkpoint contexts of ``block``'s next forward: attention saved, offloaded, probed, or plain."""
    if block.__dict__.get(_KEEP_ATTENTION):
        return attention_saved_contexts
    store = block.__dict__.get(_OFFLOAD_ATTENTION)
    if store is not None:
        return store.contexts
    probe = probe_of(block)
    if probe is not None:
        costs, index = probe
        return lambda: probe_contexts(costs, index)
    return noop_context_fn


def _wrap(block: nn.Module, original: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        # a recomputed block runs without a KV cache (the recomputation would append to it a second time)
        args, kwargs = without_kv_cache(args, kwargs)
        if torch.compiler.is_compiling():
            # traced by TorchDynamo (``torch.compile(model)``): its checkpoint takes no context function, so the
            # block is recomputed plainly (not probed, its attention outputs not kept)
            return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        partitioned = block.__dict__.get(COMPILED_PARTITIONED)
        if partitioned is not None and block.__dict__.get(_PARTITION):
            if draws_dropout(block):  # its dropout turned on since set_recompute
                raise _partitioned_dropout_error(f"a {type(block).__name__} block is")
            return partitioned(*args, **kwargs)  # the compiled region saves and recomputes: no checkpoint
        saving = block.__dict__.get(COMPILED_SAVING_ATTENTION)
        if saving is not None and block.__dict__.get(_KEEP_ATTENTION):
            # a compiled block: its checkpoint is inside the compiled region (a dispatch mode around the region
            # would run it eagerly), and the attention outputs it keeps are saved tensors of that region
            if draws_dropout(block):
                raise _compiled_dropout_error(f"a {type(block).__name__} block is")
            try:
                return saving(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
                cause = lines[1] if len(lines) > 1 else lines[0]  # "backend='inductor' raised:", then the error
                raise OffloadConfigError(
                    f"compiling {type(block).__name__}'s recomputation that keeps its attention outputs failed "
                    f"({cause}). On the GPU this is what dropout inside the block gives (torch's partitioner rejects "
                    f"saving its random draws): recompute the block without attention_saved, or leave it "
                    f"uncompiled") from e
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_context_fn(block), **kwargs)
    return forward


def set_recompute(blocks: list[nn.Module], which: Iterable[int], attention_saved: Iterable[int] = (),
                  attention_offloaded: Iterable[int] = (), attention_store: AttentionStore | None = None,
                  partitioned: Iterable[int] = ()) -> None:
    """Recompute exactly the blocks whose indices are in ``which``; restore the others.  The blocks in
    ``attention_saved`` (a subset of ``which``) keep their attention ops' outputs instead of running them again;
    those in ``attention_offloaded`` (another subset) keep them in ``attention_store``; those in ``partitioned``
    (another, of blocks compiled by `datapath.offload.regional_compile`) run their compiled region partitioned
    under its memory budget."""
    chosen = set(which)
    keep = set(attention_saved)
    moved = set(attention_offloaded)
    split = set(partitioned)
    if not split <= chosen:
        raise ValueError(f"partitioned blocks {sorted(split - chosen)} are not recomputed: pass them in ``which`` too")
    if split & (keep | moved):
        raise ValueError(f"blocks {sorted(split & (keep | moved))} are both partitioned and keep their attention "
                         f"outputs: the partitioner chooses what a partitioned block saves")
    plain = sorted(i for i in split if COMPILED_PARTITIONED not in blocks[i].__dict__)
    if plain:
        raise ValueError(f"blocks {plain} have no partitioned forward: only blocks compiled by datapath "
                         f"(offload(..., compile=True), or a dict of torch.compile options naming no mode and no "
                         f"inductor options) can be partitioned")
    random = sorted(i for i in split if draws_dropout(blocks[i]))
    if random:
        raise _partitioned_dropout_error(f"blocks {random} are")
    if not keep | moved <= chosen:
        raise ValueError(f"attention_saved / attention_offloaded blocks {sorted((keep | moved) - chosen)} are not "
                         f"recomputed: a block keeps its attention outputs only when it is recomputed (pass it in "
                         f"``which`` too)")
    if keep & moved:
        raise ValueError(f"blocks {sorted(keep & moved)} are both in attention_saved and attention_offloaded: "
                         f"a block keeps its attention outputs on the device or in the store, not both")
    if moved and attention_store is None:
        raise ValueError("attention_offloaded needs attention_store (where the outputs go)")
    random = [i for i in sorted(keep) if COMPILED_SAVING_ATTENTION in blocks[i].__dict__ and draws_dropout(blocks[i])]
    if random:
        raise _compiled_dropout_error(f"blocks {random} are")
    compiled = sorted(i for i in moved if COMPILED_SAVING_ATTENTION in blocks[i].__dict__)
    if compiled:
        raise ValueError(f"blocks {compiled} are compiled: their attention outputs cannot go to an attention store "
                         f"(its dispatch mode would run the compiled region eagerly); put them in attention_saved, "
                         f"where they are saved tensors of the compiled region that the offload store may take")
    for i, block in enumerate(blocks):
        if i in keep:
            block.__dict__[_KEEP_ATTENTION] = True
        else:
            block.__dict__.pop(_KEEP_ATTENTION, None)
        if i in split:
            block.__dict__[_PARTITION] = True
        else:
            block.__dict__.pop(_PARTITION, None)
        if i in moved:
            block.__dict__[_OFFLOAD_ATTENTION] = attention_store
        else:
            block.__dict__.pop(_OFFLOAD_ATTENTION, None)
        on = is_recomputed(block)
        if i in chosen and not on:
            had_own = "forward" in block.__dict__
            original = block.forward
            block.__dict__[_ORIGINAL] = (original, had_own)
            block.forward = _wrap(block, original)  # type: ignore[method-assign]
        elif i not in chosen and on:
            original, had_own = block.__dict__.pop(_ORIGINAL)
            if had_own:
                block.forward = original  # type: ignore[method-assign]
            else:
                del block.forward


def clear_recompute(blocks: list[nn.Module]) -> None:
    """Restore every block's own forward."""
    set_recompute(blocks, ())
