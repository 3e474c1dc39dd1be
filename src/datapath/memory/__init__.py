"""Where tensors live and how rows are fetched from them: the one place that decides.

    from datapath.memory import placement_of, kind_of, gather_rows, kernel_view
    placement_of(t)          # "cuda" | "unified" | "cpu"
    kind_of(t)               # "cuda" | "unified" | "pinned" | "shared" | "mmap" | "pageable"
    rows = gather_rows(table, cuda_idx)   # zero copy from unified/pinned host memory

Loaders, sampling, ops, nn and the feature store all ask this module; none of them
tests devices, ``is_pinned()`` or the unified subclass on its own.
"""
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
    "PLACEMENTS", "Kind", "Placement", "PlacementError", "gather_rows", "host_of", "is_unified", "kernel_view",
    "kind_of", "placement_of", "to_placement",
]
