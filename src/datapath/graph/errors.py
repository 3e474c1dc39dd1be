"""Exceptions raised by `datapath.graph`."""
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
