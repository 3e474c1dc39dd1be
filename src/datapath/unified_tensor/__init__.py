"""Unified tensors: pinned host memory that GPU kernels read directly over PCIe.

    import datapath
    feats = feats.to("unified")            # or datapath.unified_tensor.as_unified(feats): no copy
    rows = feats[cuda_idx]                  # gathered by the GPU from host memory -> CUDA tensor

See `datapath.unified_tensor.tensor` for the placement rules.  The row fetch behind
``feats[cuda_idx]`` is `datapath.memory.gather_rows` (exported here as `gather`, with
`scatter`, `ErrorFlag`, `check_errors` and `config`).  A read-only source (``np.load(...,
mmap_mode="r")``, a non-writable array) becomes a read-only unified tensor: reads work
without a copy, writes raise `ReadOnlyTableError`.
"""
from datapath._runtime import settings as _settings

from datapath.unified_tensor._config import UnifiedConfig, config
from datapath.unified_tensor._device import device_registered, install_to_unified, register_device
from datapath.memory import ErrorFlag, ReadOnlyTableError, check_errors
from datapath.memory import gather_rows as gather
from datapath.memory import scatter_rows as scatter
from datapath.unified_tensor.memory import as_unified, host_tensor, is_unified, set_affinity
from datapath.unified_tensor.shared import (
    SharedTableError, attach, cleanup_stale, share, shared_tables, shm_dir, unlink,
)
from datapath.unified_tensor.tensor import UnifiedTensor, to_unified

install_to_unified()
if _settings.at_import("DATAPATH_UNIFIED_DEVICE"):  # a bad value: said once, the device left alone
    register_device()

__all__ = [
    "ErrorFlag", "ReadOnlyTableError", "SharedTableError", "UnifiedConfig", "UnifiedTensor", "as_unified", "attach", "check_errors",
    "cleanup_stale", "config", "device_registered", "gather", "host_tensor", "is_unified", "register_device", "scatter", "set_affinity", "share",
    "shared_tables", "shm_dir", "to_unified", "unlink",
]
