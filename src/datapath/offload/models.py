"""The modules of a model that cut its forward into scopes: `auto_blocks` and `resolve_units`."""
from __future__ import annotations

from typing import Any

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
