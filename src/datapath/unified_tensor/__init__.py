"""Unified tensors: pinned host memory that GPU kernels read directly over PCIe.

    import datapath
    feats = feats.to("unified")            # or datapath.unified_tensor.as_unified(feats): no copy
    rows = feats[cuda_idx]                  # gathered by the GPU from host memory -> CUDA tensor

See `datapath.unified_tensor.tensor` for the placement rules and
`datapath.unified_tensor.gather` for the zero-copy kernels.
"""
import os

from datapath.unified_tensor._config import UnifiedConfig, config
from datapath.unified_tensor._device import device_registered, install_to_unified, register_device
from datapath.unified_tensor.gather import ErrorFlag, check_errors, gather, scatter
from datapath.unified_tensor.memory import as_unified, host_tensor, is_unified, set_affinity
from datapath.unified_tensor.shared import (
    SharedTableError, attach, cleanup_stale, share, shared_tables, shm_dir, unlink,
)
from datapath.unified_tensor.tensor import UnifiedTensor, to_unified

install_to_unified()
if os.environ.get("DATAPATH_UNIFIED_DEVICE", "") not in ("", "0"):
    register_device()

__all__ = [
    "ErrorFlag", "SharedTableError", "UnifiedConfig", "UnifiedTensor", "as_unified", "attach", "check_errors",
    "cleanup_stale", "config", "device_registered", "gather", "host_tensor", "is_unified", "register_device", "scatter", "set_affinity", "share",
    "shared_tables", "shm_dir", "to_unified", "unlink",
]
