"""Exceptions raised by `datapath.loaders`."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class InvalidGraphError(DatapathError, ValueError):
    """A graph's CSR arrays are malformed (lengths, dtypes, non-monotone ``indptr``, out-of-range ``indices``).

    Build the graph from ``indptr`` of shape (num_nodes+1,) starting at 0 and
    non-decreasing, and ``indices`` of shape (indptr[-1],) with every value in
    ``[0, num_src_nodes)``; both int32 or int64.
    """


class DatasetError(DatapathError, ValueError):
    """A dataset name is unknown, or a dataset directory is incomplete or inconsistent."""


class LoaderError(DatapathError, ValueError):
    """A sampler or loader was configured wrongly (fanouts, seeds, batch size, placement)."""


class CudaAutogradUnavailableError(DatapathError, RuntimeError):
    """CUDA training cannot run in this process: PyTorch's accelerator is not CUDA.

    Registering a PrivateUse1 backend (datapath's "unified" device) makes it PyTorch's
    accelerator; torch 2.11-2.13 then drops the streams of CUDA autograd nodes and every
    CUDA backward fails with an internal assert (pytorch/pytorch#161129).
    """
