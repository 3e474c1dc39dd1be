"""Exception types shared by every subpackage.

Each says what went wrong and what to do; callers catch the specific class.
"""
from __future__ import annotations


class DatapathError(RuntimeError):
    """Base class of every error raised by datapath."""


class CudaUnavailableError(DatapathError):
    """A CUDA-only path was asked for on a machine (or build) without a usable GPU."""


class KernelLoadError(DatapathError):
    """A CUDA kernel could not be compiled or loaded (CuPy missing, NVRTC failure)."""


class PinnedMemoryError(DatapathError, MemoryError):
    """Host memory could not be pinned: the request exceeds what the machine allows."""
