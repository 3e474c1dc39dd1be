"""The exception types shared by every part of datapath (each subpackage adds its own specific ones).

Catch `DatapathError` for anything datapath raises on purpose; every message says what
went wrong and what to do.
"""
from datapath._runtime.errors import CudaUnavailableError, DatapathError, KernelLoadError, PinnedMemoryError
from datapath._runtime.optional import MissingDependencyError

__all__ = ["CudaUnavailableError", "DatapathError", "KernelLoadError", "MissingDependencyError", "PinnedMemoryError"]
