"""Where a tensor lives (``"cpu"``, ``"unified"``, ``"cuda"``) and moving/reading it accordingly.

"unified" memory is host memory that is pinned and mapped into the GPU's address
space: GPU kernels read it over PCIe (zero copy).  The loaders accept it in two forms:

- a pinned CPU tensor (what `to_placement(t, "unified")` makes: a copy into pinned
  memory from PyTorch's caching host allocator, so PyTorch manages its lifetime);
- a `datapath.unified_tensor` tensor (e.g. ``as_unified(t)``, pinned in place).

Both are read on the GPU by `datapath.unified_tensor.gather` (zero-copy, aligned).
Pinned CPU tensors let the loaders work without creating tensors on the "unified"
device, whose PrivateUse1 registration breaks CUDA autograd in torch 2.11-2.13
(pytorch/pytorch#161129; see benchmarks/gnn_epoch.py).

Without CUDA nothing can be pinned: "unified" is ordinary host memory and every path
is the CPU path.
"""
from __future__ import annotations

from typing import Any

import torch

from datapath._runtime.pinned import cuda_alias, pinned_empty
from datapath.loaders.errors import LoaderError

PLACEMENTS = ("cpu", "unified", "cuda")


def _ut() -> Any:
    import datapath.unified_tensor as ut  # noqa: PLC0415 - loaded with the datapath package anyway

    return ut


def _is_ut(t: torch.Tensor) -> bool:
    return _ut().is_unified(t)


def placement_of(t: torch.Tensor) -> str:
    """``"cuda"``, ``"unified"`` (a unified tensor, or pinned CPU memory) or ``"cpu"`` (pageable)."""
    if _is_ut(t):  # before the device test: a unified tensor reports the cpu device
        return "unified"
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "cpu":
        return "unified" if torch.cuda.is_available() and t.is_pinned() else "cpu"
    raise LoaderError(f"tensors on device {t.device} are not supported; use cpu, unified or cuda")


def host_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding ``t``'s data (zero copy) for cpu and unified tensors."""
    if _is_ut(t):
        return _ut().host_tensor(t)
    if t.device.type == "cpu":
        return t
    raise LoaderError(f"host_of needs a host tensor, got one on {t.device}")


def to_placement(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` in ``where``: itself when already there, else a copy ("unified": pinned host memory)."""
    if where not in PLACEMENTS:
        raise LoaderError(f"placement must be one of {PLACEMENTS}, got {where!r}")
    have = placement_of(t)
    if have == where:
        return t
    if where == "cuda":
        return t.to("cuda") if t.device.type == "cpu" else host_of(t).to("cuda")
    host = host_of(t) if have == "unified" else t.to("cpu")
    if where == "cpu":
        return host.clone() if have == "unified" else host
    if not torch.cuda.is_available():  # nothing to pin: ordinary host memory
        return host
    out = pinned_empty(tuple(host.shape), host.dtype)
    out.copy_(host)
    return out


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor a kernel can read: ``t`` itself, or a zero-copy alias of unified memory."""
    if t.device.type == "cuda":
        return t
    host = host_of(t)
    if not host.is_pinned():
        raise LoaderError(
            "GPU sampling needs the graph in 'unified' or 'cuda' memory, got pageable host memory; "
            "call graph.to('unified') or sample on the CPU"
        )
    return cuda_alias(host)


def gather_rows(table: torch.Tensor, idx: torch.Tensor, error_flag: Any = None) -> torch.Tensor:
    """``table[idx]`` on ``idx``'s device.

    - ``table`` on CUDA: a GPU index_select;
    - unified ``table`` (a unified tensor or pinned CPU memory) with CUDA ``idx``: read by the
      GPU straight from host memory (`datapath.unified_tensor.gather`, zero copy; with an
      ``error_flag`` (`datapath.unified_tensor.ErrorFlag`) it does not wait for the kernel's bounds check);
    - otherwise a CPU gather, then a copy to ``idx``'s device (the DGL/PyG default path).
    """
    where = placement_of(table)
    if where == "cuda":
        return torch.index_select(table, 0, idx.to(table.device))
    if where == "unified" and idx.device.type == "cuda":
        return _ut().gather(table, idx, error_flag=error_flag)
    rows = torch.index_select(host_of(table), 0, idx.to("cpu"))
    return rows.to(idx.device) if idx.device.type != "cpu" else rows
