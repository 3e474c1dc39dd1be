"""The models a `TensorCache` is attached to: their units and blocks, and the parameters never offloaded.

`auto_blocks` and `resolve_units` name the modules of a model that cut the forward into
scopes; `AttachedModels` keeps the attached models (weakly), the blocks of the last one,
the storages of their parameters and buffers (and of tensors registered by hand), and answers
"is this saved tensor a parameter?" for the pack hook.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from datapath.offload.errors import OffloadConfigError


def _leaf_units(model: nn.Module) -> list[nn.Module]:
    """Every module below ``model`` that owns parameters itself (Linear, LayerNorm, Embedding, ...)."""
    out = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    return out or auto_blocks(model)


def auto_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``: children of its largest (by parameters) ModuleList/Sequential, else its children."""
    best: nn.Module | None = None
    best_size = -1
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    if best is not None:
        return list(best)
    return [c for c in model.children() if any(True for _ in c.parameters())]


def resolve_units(model: nn.Module, units: Any) -> list[nn.Module]:
    """``units`` as a list of modules: ``"blocks"``, ``"leaves"``, an iterable of modules, or None (blocks)."""
    if isinstance(units, str):
        if units not in ("blocks", "leaves"):
            raise OffloadConfigError(f"units must be 'blocks', 'leaves' or a list of modules, got {units!r}")
        return auto_blocks(model) if units == "blocks" else _leaf_units(model)
    return list(units) if units is not None else auto_blocks(model)


class AttachedModels:
    """The attached models with their module hooks, the blocks of the last one, and their parameters' storages."""

    def __init__(self) -> None:
        self.models: list[tuple[weakref.ref[nn.Module], list[Any]]] = []
        self.blocks: list[nn.Module] = []   # the blocks of the model attached last (what the budget recomputes)
        self._extra_params: list[weakref.ref[torch.Tensor]] = []
        self._param_keys: set[tuple[str, int, int]] = set()
        self._params_stale = False  # a forward began: refresh the keys before the next check (`is_parameter`)

    def add(self, model: nn.Module, hooks: list[Any], blocks: list[nn.Module]) -> None:
        """Remember ``model`` with the ``hooks`` installed on it; its ``blocks`` become the blocks."""
        self.blocks = blocks
        self.models.append((weakref.ref(model), hooks))
        self.refresh_params()

    def remove(self, model: nn.Module | None) -> list[tuple[nn.Module | None, list[Any]]]:
        """Forget ``model`` (every model when None); the (model, hooks) forgotten (model None when collected)."""
        keep, gone = [], []
        for ref, hooks in self.models:
            if model is None or ref() is model:
                gone.append((ref(), hooks))
            else:
                keep.append((ref, hooks))
        self.models = keep
        self.refresh_params()
        return gone

    def alive(self) -> list[nn.Module]:
        """The attached models still alive."""
        return [m for m in (ref() for ref, _ in self.models) if m is not None]

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors (nor views of their storage)."""
        for p in params:
            self._extra_params.append(weakref.ref(p))
        self.refresh_params()

    def params_may_have_moved(self) -> None:
        """A forward begins: parameters may live in new storages (FSDP2 gathers them per step); the keys are
        read again when a saved tensor is next checked, not now (a step that checks none pays nothing)."""
        self._params_stale = True

    def refresh_params(self) -> None:
        """Read the storages of the parameters and buffers again."""
        self._params_stale = False
        keys: set[tuple[str, int, int]] = set()

        def add(t: torch.Tensor) -> None:
            to_local = getattr(t, "to_local", None)
            if to_local is not None:  # a DTensor (FSDP2's sharded parameters): its local shard's storage
                t = to_local()
            if t.device.type != "meta":
                keys.add((t.device.type, t.device.index or 0, t.untyped_storage().data_ptr()))

        for m in self.alive():
            for p in m.parameters():
                add(p)
            for b in m.buffers():
                add(b)
        for r in self._extra_params:
            t = r()
            if t is not None:
                add(t)
        self._param_keys = keys

    def is_parameter(self, t: torch.Tensor, storage: Any) -> bool:
        """``t`` is a parameter, a buffer, or a view of one (never offloaded)."""
        if self._params_stale:
            self.refresh_params()
        return (t.device.type, t.device.index or 0, storage.data_ptr()) in self._param_keys or (
            t.requires_grad and t.is_leaf) or (
            t._base is not None and t._base.is_leaf and t._base.requires_grad)

    def static_bytes(self) -> int:
        """Bytes of the models' parameters, buffers and gradients (what no policy can free)."""
        seen: set[int] = set()
        total = 0
        for m in self.alive():
            for t in list(m.parameters()) + list(m.buffers()):
                for x in (t, getattr(t, "grad", None)):
                    if x is None:
                        continue
                    local = x.to_local() if hasattr(x, "to_local") else x
                    if local.device.type == "meta":
                        continue
                    st = local.untyped_storage()
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
        return total

    def cuda_model(self) -> bool:
        """Whether the first attached model's parameters are on CUDA (True with no model attached)."""
        for m in self.alive():
            p = next(m.parameters(), None)
            return p is not None and p.is_cuda
        return True
