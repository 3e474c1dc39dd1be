"""Unified tensors: pinned host memory that GPU kernels read directly over PCIe.

    import datapath
    feats = feats.to("unified")            # or datapath.unified_tensor.as_unified(feats): no copy
    rows = feats[cuda_idx]                  # gathered by the GPU from host memory -> CUDA tensor

See `datapath.unified_tensor.tensor` for the placement rules and
`datapath.unified_tensor.gather` for the zero-copy kernels.
"""
from datapath.unified_tensor._config import UnifiedConfig, config
from datapath.unified_tensor._device import register as _register
from datapath.unified_tensor.gather import check_errors, gather, scatter
from datapath.unified_tensor.memory import as_unified, host_tensor, is_unified, set_affinity
from datapath.unified_tensor.shared import (
    SharedTableError, attach, cleanup_stale, share, shared_tables, shm_dir, unlink,
)
from datapath.unified_tensor.tensor import UnifiedTensor

_register()

__all__ = [
    "SharedTableError", "UnifiedConfig", "UnifiedTensor", "as_unified", "attach", "check_errors",
    "cleanup_stale", "config", "gather", "host_tensor", "is_unified", "scatter", "set_affinity", "share",
    "shared_tables", "shm_dir", "unlink",
]
