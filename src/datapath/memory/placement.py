"""Where a tensor lives, and how a GPU kernel reads it.

This module is the one answer to "is this table unified?" (and "may it be written?"):
every other part of datapath (loaders, sampling, ops, nn, the feature store) asks it
instead of testing devices, ``is_pinned()`` or subclasses itself.  Rows are fetched by
`datapath.memory.rows`.

Kinds (`kind_of`), finest first:

==============  ===========================================================
``"cuda"``      GPU memory
``"unified"``   a `HostRecord` tensor (`datapath.unified_tensor.UnifiedTensor`: pinned, mapped)
``"pinned"``    a plain CPU tensor in page-locked memory (``pin_memory()``)
``"shared"``    pageable memory mapped from a RAM-backed file (``/dev/shm``)
``"mmap"``      pageable memory mapped from a file on disk (``np.load(mmap_mode=...)``)
``"pageable"``  ordinary process memory
==============  ===========================================================

Placements (`placement_of`) group them the way the data path cares about:
``"cuda"``; ``"unified"`` (unified or pinned: a GPU kernel reads it over PCIe,
zero copy); ``"cpu"`` (everything else: the CPU has to gather it).  Without CUDA
nothing can be pinned, so "unified" is ordinary host memory and every path is the
CPU path.
"""
from __future__ import annotations

from typing import Literal

import torch

from datapath._runtime.errors import DatapathError
from datapath._runtime.pinned import cuda_alias, mapping_file, mapping_of, mount_type, pinned_empty
from datapath.memory.host_record import HostRecord

Placement = Literal["cpu", "unified", "cuda"]
Kind = Literal["cuda", "unified", "pinned", "shared", "mmap", "pageable"]
PLACEMENTS: tuple[str, ...] = ("cpu", "unified", "cuda")
_RAM_FILESYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


class PlacementError(DatapathError, ValueError):
    """A tensor is in memory the requested path cannot use (wrong device, pageable where pinned is needed)."""


def is_unified(t: object) -> bool:
    """True for a tensor on a `HostRecord` (`datapath.unified_tensor.UnifiedTensor`; it reports
    ``device.type == "cpu"``): the one answer, also behind ``Tensor.is_unified``."""
    return isinstance(t, HostRecord)


def kind_of(t: torch.Tensor) -> Kind:
    """The memory behind ``t``: one of ``cuda``, ``unified``, ``pinned``, ``shared``, ``mmap``, ``pageable``.

    Telling ``shared``/``mmap`` from ``pageable`` reads ``/proc/self/maps`` (about 0.1 ms):
    use `placement_of` on hot paths.
    """
    if is_unified(t):  # before the device test: a unified tensor reports the cpu device
        return "unified"
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type != "cpu":
        raise PlacementError(f"tensors on device {t.device} are not supported; use cpu, unified or cuda")
    if torch.cuda.is_available() and t.is_pinned():
        return "pinned"
    if t.untyped_storage().nbytes() == 0:
        return "pageable"
    path = mapping_file(t.untyped_storage().data_ptr())
    if path is None:
        return "pageable"
    return "shared" if mount_type(path) in _RAM_FILESYSTEMS else "mmap"


def placement_of(t: torch.Tensor) -> Placement:
    """``"cuda"``, ``"unified"`` (a unified tensor, or pinned CPU memory) or ``"cpu"`` (pageable)."""
    if is_unified(t):
        return "unified"
    if t.device.type == "cuda":
        return "cuda"
    if t.device.type == "cpu":
        return "unified" if torch.cuda.is_available() and t.is_pinned() else "cpu"
    raise PlacementError(f"tensors on device {t.device} are not supported; use cpu, unified or cuda")


def split(t: torch.Tensor) -> tuple[Placement, torch.Tensor]:
    """(`placement_of` ``t``, the tensor a kernel or the CPU reads: ``t`` or, for a unified tensor, `host_of` ``t``)."""
    if isinstance(t, HostRecord):
        return "unified", t._host
    if t.is_cuda:
        return "cuda", t
    return placement_of(t), t


def is_read_only(t: torch.Tensor) -> bool:
    """True when writing into ``t``'s memory would fault: a read-only unified tensor (`as_unified` of a
    non-writable array or a read-only mapping), or a CPU tensor over a read-only mapping
    (``np.load(path, mmap_mode="r")``).  Reads ``/proc/self/maps`` for CPU tensors (about 0.1 ms)."""
    if isinstance(t, HostRecord):
        return t._readonly
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
        return False
    m = mapping_of(t.untyped_storage().data_ptr())
    return m is not None and "w" not in m[0]


def host_of(t: torch.Tensor) -> torch.Tensor:
    """The plain CPU tensor holding ``t``'s data (same memory, no copy) for cpu and unified tensors."""
    if isinstance(t, HostRecord):
        return t._host
    if t.device.type == "cpu":
        return t
    raise PlacementError(f"host_of needs a tensor in host memory, got one on {t.device}")


def to_placement(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` in ``where`` (``cpu``/``unified``/``cuda``): itself when already there, else a copy.

    ``"unified"`` gives pinned host memory from PyTorch's caching host allocator (a plain
    CPU tensor, which every datapath path reads zero-copy); use
    `datapath.unified_tensor.as_unified` to pin in place instead.
    """
    if where not in PLACEMENTS:
        raise PlacementError(f"placement must be one of {PLACEMENTS}, got {where!r}")
    have = placement_of(t)
    if have == where:
        return t
    if where == "cuda":
        return host_of(t).to("cuda") if have == "unified" else t.to("cuda")
    host = host_of(t) if have == "unified" else t.to("cpu")
    if where == "cpu":
        return host.clone() if have == "unified" else host
    if not torch.cuda.is_available():  # nothing to pin: ordinary host memory
        return host
    out = pinned_empty(tuple(host.shape), host.dtype)
    out.copy_(host)
    return out


def kernel_view(t: torch.Tensor, what: str = "the tensor") -> torch.Tensor:
    """A CUDA tensor a GPU kernel can read: ``t`` itself, or a zero-copy alias of its pinned host memory.

    Raises `PlacementError` for pageable host memory, naming ``what``.
    """
    if t.device.type == "cuda" and not is_unified(t):
        return t
    host = host_of(t)
    if host.numel() == 0 and torch.cuda.is_available():  # nothing to read (and 0 bytes are never pinned)
        return torch.empty(host.shape, dtype=host.dtype, device="cuda")
    if not torch.cuda.is_available() or not host.is_pinned():
        raise PlacementError(
            f"{what} is in pageable host memory, which a GPU kernel cannot read; make it unified "
            f"(datapath.unified_tensor.as_unified(t), pinned in place) or move it to the GPU"
        )
    return cuda_alias(host)
