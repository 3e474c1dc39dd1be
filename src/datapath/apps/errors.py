"""Exceptions raised by `datapath.apps`."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class DistributedError(DatapathError):
    """A data-parallel job could not start, or one of its processes failed."""


class CudaAutogradUnavailableError(DatapathError, RuntimeError):
    """CUDA training cannot run in this process: PyTorch's accelerator is not CUDA.

    Registering a PrivateUse1 backend (datapath's "unified" device) makes it PyTorch's
    accelerator; torch 2.11-2.13 then drops the streams of CUDA autograd nodes and every
    CUDA backward fails with an internal assert (pytorch/pytorch#161129).
    """


class NonFiniteLossError(DatapathError, ArithmeticError):
    """Training met a NaN or infinite loss (its epoch and batch named); ``--allow-nonfinite`` trains on anyway."""
