"""Where tensors live and how rows are fetched from them: the one place that decides.

    from datapath.memory import placement_of, kind_of, gather_rows, kernel_view
    placement_of(t)          # "cuda" | "unified" | "cpu"
    is_unified(t)            # a tensor on a HostRecord (UnifiedTensor): pinned buffer, read-only flag, device view
    kind_of(t)               # "cuda" | "unified" | "pinned" | "shared" | "mmap" | "pageable"
    rows = gather_rows(table, cuda_idx)   # zero copy from unified/pinned host memory, or from GPU memory
    scatter_rows(table, cuda_idx, rows)   # the write direction
    check_errors()                        # raise an out-of-range index that an earlier call found
    native_launcher(wait=True)            # build the one-call C++ launch of small gathers now (else: on first use)
    buf = pinned_empty((n, f), torch.float32)   # page-locked, GPU-mapped (checked against what can be pinned)
    buf = huge_pinned_empty((n, f), torch.float32)   # the same on 2 MiB pages (None where there are none)

Loaders, sampling, ops, nn, unified tensors and the feature store all ask this module;
none of them tests devices, ``is_pinned()`` or the unified subclass on its own, and none
gathers rows itself.  The kernels are ``kernels/gather.cu``.
"""
from datapath._runtime.errors import PinnedMemoryError
from datapath._runtime.native import NativeLauncher, native_launcher
from datapath._runtime.pinned import (
    HostRegistration, cuda_alias, pin_limit_bytes, pinned_empty, register_in_place,
)
from datapath.memory.bounds import ErrorFlag, check_errors, deferred_flag
from datapath.memory.config import GATHER_MODES, GatherConfig, config_from_env, gather_config
from datapath.memory.host_record import HostRecord, ReadOnlyTableError
from datapath.memory.huge_pages import free_hugetlb_pages, huge_page_bytes, huge_pinned_empty, thp_mode
from datapath.memory.placement import (
    PLACEMENTS,
    Kind,
    Placement,
    PlacementError,
    host_of,
    is_read_only,
    is_unified,
    kernel_view,
    kind_of,
    placement_of,
    to_placement,
)
from datapath.memory.rows import gather_rows, gather_tiered, pending_host_reads, scatter_rows

__all__ = [
    "HostRegistration", "PinnedMemoryError", "cuda_alias", "pending_host_reads", "pin_limit_bytes", "pinned_empty",
    "register_in_place",
    "free_hugetlb_pages", "huge_page_bytes", "huge_pinned_empty", "thp_mode",
    "ErrorFlag", "check_errors", "deferred_flag", "GATHER_MODES", "GatherConfig", "config_from_env", "gather_config",
    "NativeLauncher", "native_launcher",
    "PLACEMENTS", "Kind", "Placement", "PlacementError", "host_of", "is_read_only", "is_unified", "kernel_view",
    "kind_of", "placement_of", "to_placement",
    "HostRecord", "ReadOnlyTableError", "gather_rows", "gather_tiered", "scatter_rows",
]
