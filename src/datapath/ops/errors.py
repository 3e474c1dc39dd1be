"""Exceptions raised by `datapath.ops` (and the layers of `datapath.nn` built on it)."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class GraphFormatError(DatapathError, ValueError):
    """The graph given to an op is not a valid CSR of destination rows.

    Pass an object with ``indptr`` ((num_dst+1,) int32/int64, starting at 0,
    non-decreasing, ending at E), ``indices`` ((E,) int32/int64 source ids in
    ``[0, num_src_nodes)``), ``num_src_nodes`` and ``num_dst_nodes``; or a tuple
    ``(indptr, indices, num_src_nodes)``.
    """


class GraphIndexError(DatapathError, IndexError):
    """A source id (graph ``indices`` or a ``src_ids`` map) is outside the feature table."""


class FeatureShapeError(DatapathError, ValueError):
    """Features, edge weights or scores do not match the graph (rows, edges, heads) or each other."""


class DeviceMismatchError(DatapathError, ValueError):
    """The graph, the features and the weights live on different devices; move them to one device."""


class UnsupportedDtypeError(DatapathError, TypeError):
    """A tensor has a dtype the op does not handle (features: float16/bfloat16/float32/float64)."""
