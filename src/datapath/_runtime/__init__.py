"""Shared runtime: device detection, errors, pinned memory, CUDA kernel loading.

Private to datapath; subpackages import from here.
"""
from datapath._runtime.device import cuda_available, device_label, machine_info, require_cuda
from datapath._runtime.errors import (
    CudaUnavailableError,
    DatapathError,
    KernelLoadError,
    PinnedMemoryError,
)
from datapath._runtime.pinned import (
    HostRegistration,
    cuda_alias,
    pin_limit_bytes,
    fetch_to_host,
    pinned_empty,
    register_in_place,
)

__all__ = [
    "CudaUnavailableError", "DatapathError", "HostRegistration", "KernelLoadError",
    "PinnedMemoryError", "cuda_alias", "cuda_available", "device_label", "machine_info",
    "pin_limit_bytes", "fetch_to_host", "pinned_empty", "register_in_place", "require_cuda",
]
