"""Validation of feature / weight / id tensors, and the choice of backend (torch or CUDA kernels)."""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch

from datapath import memory
from datapath.ops import _torch_backend
from datapath.ops._graph import CSRView
from datapath.ops.errors import (
    DeviceMismatchError,
    FeatureShapeError,
    GraphIndexError,
    UnsupportedDtypeError,
)

log = logging.getLogger("datapath.ops")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FeatureShapeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise UnsupportedDtypeError(f"{what} has dtype {t.dtype}; use float16, bfloat16, float32 or float64")


def check_device(t: torch.Tensor, device: torch.device, what: str) -> None:
    if t.device != device:
        raise DeviceMismatchError(
            f"{what} is on {t.device} but the computation runs on {device} (where the graph and features are); "
            f"move it with .to({str(device)!r})"
        )


def check_graph_device(csr: CSRView, device: torch.device) -> None:
    if csr.device != device:
        raise DeviceMismatchError(
            f"the graph's CSR is on {csr.device} but the features are on {device}; move the graph "
            f"(graph.to({str(device)!r}) or its indptr/indices) to the features' device"
        )


def is_unified(t: torch.Tensor) -> bool:
    """True for a datapath unified tensor (pinned host memory; it reports the cpu device)."""
    return memory.is_unified(t)


def resolve_table(x: torch.Tensor, src_ids: torch.Tensor) -> torch.Tensor:
    """The feature table as a tensor on ``src_ids``' device (a CUDA alias of pinned host memory if needed)."""
    if x.numel() == 0 and x.device.type == "cpu":  # nothing to read (an empty tensor cannot even be pinned)
        return torch.empty(x.shape, dtype=x.dtype, device=src_ids.device)
    where = memory.placement_of(x)
    data = x if where == "cuda" else memory.host_of(x)
    if not data.is_contiguous():
        raise FeatureShapeError("the feature table read through src_ids must be contiguous (rows of F values)")
    if src_ids.device.type == "cuda" and where != "cuda":
        if where != "unified":
            raise DeviceMismatchError(
                "a CPU feature table read by the GPU through src_ids must be pinned: make it unified with "
                "datapath.unified_tensor.as_unified(table) (pins in place), or move it to the GPU"
            )
        return memory.kernel_view(x, "the feature table")
    check_device(data, src_ids.device, "the feature table")
    return data


def check_ids(ids: torch.Tensor, num_rows: int, expected_len: int, what: str) -> torch.Tensor:
    """Validate a (expected_len,) integer id map into a table of ``num_rows`` rows; returns it as int64."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise FeatureShapeError(f"{what} must be an int32/int64 tensor")
    if ids.dim() != 1 or ids.numel() != expected_len:
        raise FeatureShapeError(
            f"{what} must have shape ({expected_len},) (one table row per source node), got {tuple(ids.shape)}"
        )
    if ids.numel() > 0:
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
        if lo < 0 or hi >= num_rows:
            raise GraphIndexError(
                f"{what} ranges over [{lo}, {hi}] but the feature table has {num_rows} rows; ids must lie in "
                f"[0, {num_rows})"
            )
    return ids.long()


_CUDA_BACKEND: list[ModuleType] = []


def backend_for(device: torch.device) -> ModuleType:
    """The module implementing the ops on ``device``: CUDA kernels on a GPU, plain torch otherwise."""
    if device.type != "cuda":
        return _torch_backend
    if not _CUDA_BACKEND:
        from datapath.ops import _cuda_backend  # noqa: PLC0415

        _CUDA_BACKEND.append(_cuda_backend if _cuda_backend.available() else _torch_backend)
    return _CUDA_BACKEND[0]


def flat_features(x: torch.Tensor, what: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` (N, F) or (N, H, D) as a contiguous (N, F) view and the trailing shape to restore."""
    if x.dim() not in (2, 3):
        raise FeatureShapeError(f"{what} must be 2-D (N, F) or 3-D (N, H, D), got shape {tuple(x.shape)}")
    tail = tuple(x.shape[1:])
    if x.dim() == 2:
        return (x if x.is_contiguous() else x.contiguous()), tail
    return x.reshape(x.shape[0], tail[0] * tail[1]).contiguous(), tail  # explicit width: 0 rows or 0 columns


def edge_weight_heads(w: Any, num_edges: int, tail: tuple[int, ...], device: torch.device) -> int:
    """Validate an edge weight of shape (E,), (E, 1) or (E, H) against features of trailing shape ``tail``."""
    check_float(w, "edge_weight")
    check_device(w, device, "edge_weight")
    if w.dim() == 1 or (w.dim() == 2 and w.shape[1] == 1):
        heads = 1
    elif w.dim() == 2:
        heads = int(w.shape[1])
        if len(tail) != 2 or tail[0] != heads:
            raise FeatureShapeError(
                f"an edge weight with {heads} heads, shape {tuple(w.shape)}, needs features of shape "
                f"(N, {heads}, D); got trailing shape {tail}"
            )
    else:
        raise FeatureShapeError(f"edge_weight must be (E,), (E, 1) or (E, H), got shape {tuple(w.shape)}")
    if w.shape[0] != num_edges:
        raise FeatureShapeError(
            f"edge_weight has {w.shape[0]} entries but the graph has {num_edges} edges (one per CSR position)"
        )
    return heads
