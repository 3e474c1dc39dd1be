"""Storage-level identity of saved tensors, and rebuilding a view from the bytes of its storage.

A saved tensor is described by its storage (written once, whatever number of
views of it autograd saves) plus a `ViewSpec` (offset, shape, stride, dtype and
the lazy conj/neg bits).  Reloading gives back a tensor with exactly the same
metadata over a fresh copy of the storage, so every view is bit-identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ViewSpec:
    """How a tensor sits in its storage: ``offset``/``shape``/``stride`` in elements of ``dtype``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool = False
    neg: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> "ViewSpec":
        return ViewSpec(t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                        bool(t.is_conj()), bool(t.is_neg()))


def is_plain_strided(t: torch.Tensor) -> bool:
    """True for an ordinary dense strided tensor whose bytes can be moved (no subclass, sparse, quantized, meta)."""
    return (
        type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    ) and t.layout == torch.strided and not t.is_quantized and t.device.type in ("cpu", "cuda") \
        and not t.is_nested


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` tensor aliasing the whole storage of ``t`` (same device, no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def rebuild(data: torch.Tensor, spec: ViewSpec) -> torch.Tensor:
    """The view described by ``spec`` over ``data`` (a 1-D ``uint8`` tensor holding the whole storage)."""
    out = torch.empty(0, dtype=spec.dtype, device=data.device).set_(
        data.untyped_storage(), spec.offset, spec.shape, spec.stride)
    if spec.neg:
        out = torch._neg_view(out)
    if spec.conj:
        out = out.conj()
    return out


def check_version(t: torch.Tensor | None, version: int, spec: ViewSpec) -> None:
    """Raise autograd's in-place error when the saved tensor ``t`` (if still alive) moved past ``version``."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a saved tensor of shape {list(spec.shape)} is at version {t._version}; "
            f"expected version {version} instead (datapath.offload checks this in autograd's place).")
