"""Saved tensors that one elementwise op made from other saved tensors: recomputed in backward, never stored.

In a GELU MLP, ``fc2(gelu(h))`` saves both ``h`` (GELU's backward needs it) and
``gelu(h)`` (fc2's weight gradient needs it), four times the hidden size each; in a
SwiGLU MLP, ``down(silu(g) * u)`` saves ``g``, ``silu(g)``, ``u`` and the product.
The outputs are one elementwise kernel away from inputs that autograd keeps anyway:
`OpRecipes` replaces such a saved output by a `Recipe` (the op and its inputs' packed
forms), and the unpack runs the op again.  The same kernel on the same bits gives the
same bits, so gradients stay bit-identical; what is saved drops by those outputs (for a
GELU MLP, a quarter of a layer's activations), at the cost of an elementwise kernel in
backward.  Torch's compiler does this in its partitioner; this does it in eager mode.

How a saved output is recognised: the pack hook sees a tensor whose storage was made by
an op in `RECOMPUTABLE` (its ``grad_fn``, or its view base's) and each of whose inputs
was itself saved in this forward: every packed tensor is remembered in its autograd
node's ``metadata`` (keyed by output number, weakly: no saved tensor lives longer for it),
so the inputs are found through the op's ``next_functions``; a recipe holds them until it
is unpacked.  Parameters are taken as they
are.  An input saved in a changed version (in-place op) raises the error autograd raises.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from datapath.offload.views import ViewSpec, check_version, rebuild


def _gelu(node: Any) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    approximate = node._saved_approximate
    return lambda xs: torch.ops.aten.gelu.default(xs[0], approximate=approximate)


# the ops whose outputs are recomputed: grad_fn name -> (number of inputs, the op given the node)
RECOMPUTABLE: dict[str, tuple[int, Callable[[Any], Callable[[list[torch.Tensor]], torch.Tensor]]]] = {
    "GeluBackward0": (1, _gelu),
    "SiluBackward0": (1, lambda node: lambda xs: torch.ops.aten.silu.default(xs[0])),
    "MulBackward0": (2, lambda node: lambda xs: torch.ops.aten.mul.Tensor(xs[0], xs[1])),
}


class Recipe:
    """What autograd keeps instead of a recomputable saved tensor: the op, its inputs' packed forms, the view."""

    __slots__ = ("op", "inputs", "versions", "spec", "shape", "dtype", "nbytes", "tref", "version", "op_name",
                 "__weakref__")

    def __init__(self, op: Callable[[list[torch.Tensor]], torch.Tensor], op_name: str, inputs: list[Any],
                 base: torch.Tensor, t: torch.Tensor) -> None:
        self.op, self.op_name, self.inputs = op, op_name, inputs
        self.versions = [x._version if isinstance(x, torch.Tensor) else None for x in inputs]
        self.spec = ViewSpec.of(t)
        self.shape, self.dtype = tuple(base.shape), base.dtype
        self.nbytes = base.untyped_storage().nbytes()
        self.tref = weakref.ref(t)
        self.version = t._version

    def run(self, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The saved tensor again: the inputs unpacked (``unpack``), the op run, the view rebuilt."""
        check_version(self.tref(), self.version, self.spec)
        xs = []
        for x, v in zip(self.inputs, self.versions):
            if v is not None and x._version != v:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: an input of the recomputed {self.op_name} (shape {list(x.shape)}) is at version "
                    f"{x._version}; expected version {v} instead.")
            xs.append(unpack(x))
        with torch.no_grad(), torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            out = self.op(xs)
        if tuple(out.shape) != self.shape or out.dtype != self.dtype or not out.is_contiguous() \
                or out.untyped_storage().nbytes() != self.nbytes:
            raise RuntimeError(f"datapath.offload: recomputing {self.op_name} gave {tuple(out.shape)} {out.dtype}, "
                               f"not the saved {self.shape} {self.dtype}; turn recompute_elementwise off and "
                               "report this model")
        return rebuild(out, self.spec)


class OpRecipes:
    """Remembers what each forward packed, per autograd node, and makes `Recipe` s from it."""

    def __init__(self) -> None:
        self.attr = f"_datapath_packed_{id(self):x}"

    def remember(self, t: torch.Tensor, packed: Any) -> None:
        """``packed`` is what the pack hook returned for ``t``: found later through ``t``'s autograd node."""
        node = t.grad_fn
        if node is not None:  # weakly: autograd holds what it saved as long as it needs it, and no longer
            node.metadata.setdefault(self.attr, {})[t.output_nr] = weakref.ref(packed)

    def recipe(self, t: torch.Tensor) -> Recipe | None:
        """A `Recipe` for ``t`` when its storage is the output of a `RECOMPUTABLE` op whose inputs were packed."""
        base = t._base if t._is_view() else t
        node = base.grad_fn
        if node is None:
            return None
        name = type(node).__name__
        spec = RECOMPUTABLE.get(name)
        if spec is None or base.storage_offset() != 0 or not base.is_contiguous() \
                or base.untyped_storage().nbytes() != base.numel() * base.element_size():
            return None
        n_in, make = spec
        nexts = node.next_functions
        if len(nexts) != n_in:
            return None
        inputs: list[Any] = []
        for fn, nr in nexts:
            if fn is None:
                return None
            if type(fn).__name__ == "AccumulateGrad":
                inputs.append(fn.variable.detach())  # a parameter (or another leaf): kept by its owner
                continue
            ref = fn.metadata.get(self.attr, {}).get(nr)
            packed = ref() if ref is not None else None
            if packed is None:
                return None
            inputs.append(packed)
        return Recipe(make(node), name, inputs, base, t)
