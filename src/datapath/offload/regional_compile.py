"""Regional compilation: each block's forward compiled by `torch.compile`, the offloader's hooks and plan outside.

``offload(model, memory_budget=..., compile=True)`` compiles the model's blocks (the
layers of its largest ``ModuleList``) one region at a time, as PyTorch's regional
compilation recipe does: one compiled function per block class, shared by every
block of that class (so a 32-layer model compiles one layer), and a Hugging Face
model's loss function (the upcast logits and the cross-entropy fused) and output
head (its matmuls padded to aligned shapes); the embeddings stay eager.  A compiled block saves what the compiler's
partitioner decides (fused norms and activations are recomputed inside the block's
backward), so fewer bytes are saved than in eager mode; the saved tensors reach the offloader's
saved-tensor hooks when the block's forward returns, and its module hooks run
eagerly around the compiled region.  So the budget planner plans on what the
compiled graph still saves, and its choices per block compose with the compiler's:

- keep: the compiled block as it is;
- offload: its saved tensors go to the store as the block returns, and come back
  before its backward;
- recompute: `torch.utils.checkpoint` (non-reentrant, RNG state replayed) around the
  compiled forward: the same compiled graph runs again in backward, so gradients are
  bit-identical to the compiled model's without offloading, dropout included;
- recompute by the compiler's partitioner (``set_recompute(..., partitioned=...)``): a third
  compiled function per block class, compiled with `PARTITION_BUDGET` as
  ``torch._functorch.config.activation_memory_budget`` (what ``torch.compile``'s memory budget
  does to a whole model): the partitioner saves the outputs that buy back the most recompute
  time per byte (at long context, the attention's and some matmuls') and recomputes the rest
  inside the compiled backward; the tensors it saves reach the saved-tensor hooks as a kept
  block's do.  Another compiled graph, so its gradients match the compiled block's to rounding,
  not bit for bit.  A block that draws random numbers is refused: one with dropout it can see
  (`datapath.offload.recompute.draws_dropout`) by `set_recompute`, any other when it compiles;
- recompute keeping the attention outputs (``set_recompute(..., attention_saved=...)``): a
  second compiled function per block class, the class's forward under non-reentrant
  checkpointing with the selective policy of `datapath.offload.attention_saved` inside the
  compiled region (torch.compile's supported form of selective checkpointing; a dispatch mode
  around a compiled region would run it eagerly).  The compiler's partitioner then saves the
  block's inputs and its attention ops' outputs and recomputes everything else in the
  compiled backward; those saved tensors reach the saved-tensor hooks like any other, so the
  offload store may take them.  Ops that draw from the RNG are saved too, never drawn again,
  so the backward matches the forward that ran; but this is another compiled graph, whose
  draws are not the plain block's: with dropout on, its masks differ from the compiled model's.
  On the GPU, torch's partitioner rejects the saved draws outright.  So a compiled block
  with dropout is refused this (`datapath.offload.recompute.draws_dropout`; dropout it cannot
  see, a functional call, ends in a clear error at its first forward on the GPU), and the
  budget planner offers it only to blocks without dropout.

Hooks on modules inside a block would break the compiled graph, so a compiled model's
units are its blocks (``units="blocks"``), and the selective recompute of cheap
modules (`datapath.offload.cheap_recompute`) is left to the compiler.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from datapath.offload.attention_saved import compiled_attention_saved_contexts
from datapath.offload.errors import OffloadConfigError
from datapath.offload.recompute import COMPILED_PARTITIONED, COMPILED_SAVING_ATTENTION, without_kv_cache
from datapath.offload.models import auto_blocks

PARTITION_BUDGET = 0.1
"""``activation_memory_budget`` of a block's partitioned recomputation: the share of its activation memory (between
the partitioner's least and what the plain compiled block saves) it may save.  Low enough that every block
partitioned can stay near full checkpointing's peak; whether it beats checkpointing depends on the card, so the
budget's trial decides (docs/benchmarks.md, B6 FSDP2)."""

_ORIGINAL = "_datapath_compiled_original"
_COMPILE_KEYS = ("mode", "dynamic", "fullgraph", "backend", "options")
_cache: dict[tuple[Any, str], Any] = {}
_LOSS = "_datapath_compiled_loss"


def check_compile_options(value: Any) -> dict[str, Any] | None:
    """``compile=`` as `torch.compile` keyword arguments (None: off); `OffloadConfigError` names a bad one."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise OffloadConfigError(f"compile must be True, False or a dict of torch.compile options "
                                 f"({', '.join(_COMPILE_KEYS)}), got {value!r}")
    bad = sorted(set(value) - set(_COMPILE_KEYS))
    if bad:
        raise OffloadConfigError(f"compile={dict(value)!r}: unknown torch.compile option(s) {bad}; "
                                 f"known: {', '.join(_COMPILE_KEYS)}")
    return dict(value)


def _compiled(fn: Any, options: dict[str, Any]) -> Any:
    """One compiled ``fn`` per (function, options): blocks of one class share its graphs."""
    key = (fn, repr(sorted(options.items(), key=lambda kv: kv[0])))
    out = _cache.get(key)
    if out is None:
        out = _cache[key] = torch.compile(fn, **options)
    return out


_saving: dict[Any, Any] = {}


def _saving_attention(forward: Any) -> Any:
    """``forward`` (a block class's) under non-reentrant checkpointing that keeps the attention ops' outputs: one
    function per class forward, so that its compiled graphs are shared as the plain forward's are."""
    out = _saving.get(forward)
    if out is None:
        def saving(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(forward, block, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=compiled_attention_saved_contexts, **kwargs)
        out = _saving[forward] = saving
    return out


_partitioning: dict[Any, Any] = {}


def _partitioned(forward: Any) -> Any:
    """``forward`` (a block class's) as a function of its own, so that its compiled graphs (partitioned under
    `PARTITION_BUDGET`) are not the plain forward's: one per class forward."""
    out = _partitioning.get(forward)
    if out is None:
        def partitioned(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return forward(block, *args, **kwargs)
        out = _partitioning[forward] = partitioned
    return out


_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
_RANDOM_FUNCTIONS = ("bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
                     "multinomial", "normal", "poisson", "rrelu")
_RANDOM_METHODS = ("bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "geometric_", "cauchy_",
                   "log_normal_", "random_")


def _draws_random(node: Any) -> bool:
    """Whether a node of a TorchDynamo graph draws from the RNG (a dropout, a sampling op, an attention call with
    a dropout probability that is not a constant 0)."""
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    if name == "scaled_dot_product_attention":
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    if name in _DROPOUTS:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        train = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return not ((isinstance(p, (int, float)) and p == 0) or train is False)
    return name in _RANDOM_FUNCTIONS and getattr(node.target, "__module__", "") in ("torch", "torch.functional",
                                                                                     "torch.nn.functional", None)


class RandomOpInPartitionedBlock(OffloadConfigError):
    """A block's partitioned recomputation draws random numbers: refused (see `_refusing_random`)."""


_refusing: dict[str, dict[str, Any]] = {}


def _refusing_random(options: dict[str, Any]) -> dict[str, Any] | None:
    """``options`` with their backend wrapped to refuse a graph that draws random numbers (one per options, so
    that every block of a class shares its compiled graphs); None where ``options`` name a ``mode`` or inductor
    ``options`` (a backend of its own would drop them): such blocks are not partitioned.

    Under a memory budget torch's partitioner may recompute a random op in the backward, where it draws anew: the
    backward then applies other dropout masks than the forward did, and nothing says so (PyTorch issue 190758).
    A partitioned block is compiled only where its graph
    draws nothing: a dropout `datapath.offload.recompute.draws_dropout` cannot see (a functional call) is refused
    by this backend when the block first compiles, before its step runs."""
    if "mode" in options or "options" in options:
        return None
    key = repr(sorted(options.items(), key=lambda kv: kv[0]))
    out = _refusing.get(key)
    if out is None:
        from torch._dynamo.backends.registry import lookup_backend  # noqa: PLC0415

        backend = options.get("backend", "inductor")
        compiler = lookup_backend(backend) if isinstance(backend, str) else backend

        def refusing(gm: Any, inputs: Any) -> Any:
            drawn = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if _draws_random(n)]
            if drawn:
                raise RandomOpInPartitionedBlock(f"it draws random numbers ({', '.join(sorted(set(drawn))[:3])})")
            return compiler(gm, inputs)
        out = _refusing[key] = {**options, "backend": refusing}
    return out


def _under_partition_budget(compiled: Any, name: str) -> Any:
    """``compiled`` called with `PARTITION_BUDGET` as the partitioner's activation memory budget (read when the
    call compiles: its first call, or a recompilation); a graph drawing random numbers refused
    (`_refusing_random`) with `OffloadConfigError`."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with functorch_config.patch(activation_memory_budget=PARTITION_BUDGET):
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            why = str(e.inner_exception) if isinstance(getattr(e, "inner_exception", None),
                                                      RandomOpInPartitionedBlock) else None
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            cause = why or (lines[1] if len(lines) > 1 else lines[0])
            raise OffloadConfigError(
                f"{name} cannot be partitioned: {cause}. Under a memory budget torch's partitioner may draw a "
                f"random op again in the backward with other numbers (PyTorch issue 190758): recompute the block "
                f"without partitioned") from e
    return call


def is_compiled(block: nn.Module) -> bool:
    """True when datapath compiled ``block``'s forward."""
    return _ORIGINAL in block.__dict__


def _blocks(what: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The regions compiled per module: a list as given; a model's blocks and its output head."""
    if not isinstance(what, nn.Module):
        return list(what)
    blocks = auto_blocks(what)
    head = _output_head(what, blocks)
    return blocks + ([head] if head is not None else [])


def _output_head(model: nn.Module, blocks: list[nn.Module]) -> nn.Module | None:
    """A Hugging Face model's output projection (``get_output_embeddings()``) when it lies outside the blocks."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, nn.Module) or head is model:
        return None
    inside = {id(m) for b in blocks for m in b.modules()}
    return None if id(head) in inside else head


def _training_forward(compiled: Any, block: nn.Module) -> Any:
    """``block``'s compiled forward; a training call (module in training mode, grad enabled) runs without a KV cache.

    A Hugging Face layer updates the KV cache entry of its own ``layer_idx``, so the compiled
    graph guards on that entry and every layer compiles its own graph, until torch.compile's
    recompile limit (8) sends the later layers back to eager, where a recomputed layer may
    save other tensors than its first run did.  Training needs no cache (one forward per
    batch), and Hugging Face's own gradient checkpointing drops it in the same way; inference
    (eval mode or no grad) keeps it.
    """
    def forward(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            args, kwargs = without_kv_cache(args, kwargs)
        return compiled(block, *args, **kwargs)
    return forward


def _head_options(options: dict[str, Any]) -> dict[str, Any]:
    """The output head's compile options: Inductor told to pad its matmuls' shapes.

    A vocabulary is often no multiple of 8 (GPT-2's 50257): cuBLAS then runs the head's three
    matmuls on slower unaligned kernels, and Inductor's own choice to pad them is a timing
    benchmark made at compile time, which can go either way from one process to the next.  The
    head is always worth padding (the padded weight copy is small beside the logits), so the
    choice is forced.  Left as given when the user names a ``mode`` (`torch.compile` takes no
    ``options`` with one), another backend, or ``force_shape_pad`` themselves.
    """
    if "mode" in options or options.get("backend", "inductor") != "inductor":
        return options
    inner = dict(options.get("options") or {})
    inner.setdefault("force_shape_pad", True)
    return {**options, "options": inner}


def compile_blocks(blocks: nn.Module | list[nn.Module], options: dict[str, Any] | None = None) -> int:
    """Replace each block's forward by the compiled forward of its class; the number compiled now.

    ``blocks``: a list of modules, or a model (its blocks: the layers of its largest
    ``ModuleList``/``Sequential``; and a Hugging Face model's output head and
    ``loss_function``, compiled too).  ``options``: `torch.compile` keyword arguments.
    The module tree, parameter names and state dict stay as they are; `uncompile_blocks`
    restores the eager forward.  A block whose instance already has its own ``forward``
    (a wrapper someone installed) is refused before any block changes: the compiled
    function calls the class's forward and would bypass that wrapper.
    """
    todo = [b for b in _blocks(blocks) if not is_compiled(b)]
    for b in todo:
        if "forward" in b.__dict__:
            raise OffloadConfigError(
                f"compile=True: block {b.__class__.__name__} has its forward replaced on the instance already "
                f"(by another wrapper); remove that wrapper or pass compile=False")
    head = _output_head(blocks, auto_blocks(blocks)) if isinstance(blocks, nn.Module) else None
    n = 0
    for b in todo:
        b.__dict__[_ORIGINAL] = True
        if b is head:
            b.forward = functools.partial(_compiled(type(b).forward, _head_options(options or {})), b)
        else:
            b.forward = _training_forward(_compiled(type(b).forward, options or {}), b)  # type: ignore[method-assign]
            b.__dict__[COMPILED_SAVING_ATTENTION] = _training_forward(
                _compiled(_saving_attention(type(b).forward), options or {}), b)  # compiled at its first call
            refusing = _refusing_random(options or {})
            if refusing is not None:
                b.__dict__[COMPILED_PARTITIONED] = _training_forward(
                    _under_partition_budget(_compiled(_partitioned(type(b).forward), refusing), type(b).__name__), b)
        n += 1
    if isinstance(blocks, nn.Module) and not getattr(blocks, _LOSS, False):
        # a Hugging Face model's loss (upcast logits, cross-entropy) compiled too: one fused kernel each way
        # instead of several passes over the (tokens x vocab) logits in float32, and those not held
        loss = getattr(blocks, "loss_function", None)
        if callable(loss) and "_loss_function" not in blocks.__dict__:
            blocks.loss_function = _compiled(loss, options or {})
            setattr(blocks, _LOSS, True)
    return n


def uncompile_blocks(blocks: nn.Module | list[nn.Module]) -> None:
    """Give every block compiled by `compile_blocks` its eager forward back (a list, or a model's blocks)."""
    for b in _blocks(blocks):
        if is_compiled(b):
            del b.__dict__[_ORIGINAL]
            b.__dict__.pop(COMPILED_SAVING_ATTENTION, None)
            b.__dict__.pop(COMPILED_PARTITIONED, None)
            del b.forward
    if isinstance(blocks, nn.Module) and blocks.__dict__.pop(_LOSS, False):
        blocks.__dict__.pop("_loss_function", None)
