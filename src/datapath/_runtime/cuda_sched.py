"""Make host waits on the GPU sleep instead of spin (CUDA's blocking-sync scheduling).

By default a CUDA context may busy-wait in every synchronization, burning a CPU
core for as long as the GPU works; with ``CU_CTX_SCHED_BLOCKING_SYNC`` the waiting
thread sleeps.  PyTorch does not expose the flag, so it is set on the device's
primary context through the driver API, before (or, on recent drivers, after)
PyTorch creates it.  Used by ``datapath train-gnn`` and the B2 benchmark.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from datapath._runtime.kernels import libcuda

log = logging.getLogger("datapath.runtime.cuda_sched")

_CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def use_blocking_sync(device: int = 0) -> bool:
    """Ask CUDA to block (sleep) rather than spin in host synchronizations. True when set."""
    cuda = libcuda()
    if cuda is None:
        return False
    if cuda.cuInit(0) != 0:
        return False
    dev = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return False
    rc = cuda.cuDevicePrimaryCtxSetFlags(dev, _CU_CTX_SCHED_BLOCKING_SYNC)
    if rc != 0:
        log.warning("could not set blocking-sync scheduling (CUDA driver error %d); host waits will spin", rc)
        return False
    if torch.cuda.is_initialized():
        log.debug("blocking sync set after PyTorch initialized CUDA")
    return True
