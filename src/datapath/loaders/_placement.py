"""Where a tensor lives (``"cpu"``, ``"unified"``, ``"cuda"``) and moving/reading it accordingly.

"unified" is `datapath.unified_tensor`: host memory pinned in place and mapped
into the GPU's address space.  GPU kernels read it over PCIe (zero copy); on a
machine without CUDA it is ordinary host memory.
"""
from __future__ import annotations

from typing import Any

import torch

from datapath._runtime.pinned import cuda_alias
from datapath.loaders.errors import LoaderError

PLACEMENTS = ("cpu", "unified", "cuda")


def _ut() -> Any:
    import datapath.unified_tensor as ut  # noqa: PLC0415 - the unified device registers on import

    return ut


def placement_of(t: torch.Tensor) -> str:
    """``"cuda"``, ``"unified"`` or ``"cpu"`` for tensor ``t``."""
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "cpu":
        return "cpu"
    if _ut().is_unified(t):
        return "unified"
    raise LoaderError(f"tensors on device {t.device} are not supported; use cpu, unified or cuda")


def to_placement(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` moved to ``where`` (no copy when it is already there; "unified" pins CPU memory in place)."""
    if where not in PLACEMENTS:
        raise LoaderError(f"placement must be one of {PLACEMENTS}, got {where!r}")
    have = placement_of(t)
    if have == where:
        return t
    if where == "unified":
        host = t if have == "cpu" else t.to("cpu")
        return _ut().as_unified(host.contiguous())
    if have == "unified":
        host = _ut().host_tensor(t)
        return host if where == "cpu" else host.to("cuda")
    return t.to(where)


def host_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a unified tensor (zero copy); CPU tensors are returned as they are."""
    if t.device.type == "cpu":
        return t
    return _ut().host_tensor(t)


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor a kernel can read: ``t`` itself, or a zero-copy alias of a unified / pinned CPU tensor."""
    if t.device.type == "cuda":
        return t
    host = host_of(t)
    if not host.is_pinned():
        raise LoaderError(
            "GPU sampling needs the graph in 'unified' or 'cuda' memory, got pageable host memory; "
            "call graph.to('unified') (pins in place) or sample on the CPU"
        )
    return cuda_alias(host)


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` on ``idx``'s device.

    - ``table`` on CUDA: a GPU index_select;
    - ``table`` unified with CUDA ``idx``: the zero-copy GPU gather (`datapath.unified_tensor.gather`);
    - ``table`` on the CPU (or unified with a CPU ``idx``): a CPU gather, then a copy to ``idx``'s device
      (pageable, the DGL/PyG default path).
    """
    where = placement_of(table)
    if where == "cuda":
        return torch.index_select(table, 0, idx.to(table.device))
    if where == "unified" and idx.device.type == "cuda":
        return _ut().gather(table, idx)
    rows = torch.index_select(host_of(table), 0, idx.to("cpu"))
    return rows.to(idx.device) if idx.device.type != "cpu" else rows
