"""Where tensors live and how rows are fetched from them: the one place that decides.

    from datapath.memory import placement_of, kind_of, gather_rows, kernel_view
    placement_of(t)          # "cuda" | "unified" | "cpu"
    kind_of(t)               # "cuda" | "unified" | "pinned" | "shared" | "mmap" | "pageable"
    rows = gather_rows(table, cuda_idx)   # zero copy from unified/pinned host memory
    buf = pinned_empty((n, f), torch.float32)   # page-locked, GPU-mapped (checked against what can be pinned)

Loaders, sampling, ops, nn and the feature store all ask this module; none of them
tests devices, ``is_pinned()`` or the unified subclass on its own.
"""
from datapath._runtime.errors import PinnedMemoryError
from datapath._runtime.pinned import (
    HostRegistration, cuda_alias, pending_host_reads, pin_limit_bytes, pinned_empty, register_in_place,
)
from datapath.memory.placement import (
    PLACEMENTS,
    Kind,
    Placement,
    PlacementError,
    gather_rows,
    host_of,
    is_unified,
    kernel_view,
    kind_of,
    placement_of,
    to_placement,
)

__all__ = [
    "HostRegistration", "PinnedMemoryError", "cuda_alias", "pending_host_reads", "pin_limit_bytes", "pinned_empty",
    "register_in_place",
    "PLACEMENTS", "Kind", "Placement", "PlacementError", "gather_rows", "host_of", "is_unified", "kernel_view",
    "kind_of", "placement_of", "to_placement",
]
