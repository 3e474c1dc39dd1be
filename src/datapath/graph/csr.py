"""The CSR protocol every graph-shaped object in datapath speaks.

A CSR of destination rows: row ``d`` lists the source ids
``indices[indptr[d]:indptr[d+1]]`` of the edges ``src -> d``.  `datapath.graph.Graph`
(a whole graph), `datapath.sampling.Block` (one sampled layer) and `CSRGraph` (a
bare CSR, e.g. a graph with self loops added) all follow it, and `datapath.ops`
accepts any object that does (or a tuple ``(indptr, indices, num_src_nodes)``).

Derived data (degrees, the transposed CSR for backward, kernel schedules) is never
stored on these objects by the ops: it lives in plans held by the caller or in a
cache keyed weakly by the graph object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CSR(Protocol):
    """What a graph must provide.

    Attributes:
        indptr: (num_dst_nodes+1,) int32/int64, non-decreasing from 0 to E.
        indices: (E,) int32/int64 source ids in ``[0, num_src_nodes)``.
        num_src_nodes: number of source nodes (columns).
        num_dst_nodes: number of destination rows.

    An optional boolean attribute ``trusted`` says the contents are valid by construction
    (sampled blocks): consumers then check shapes and dtypes but not the index range.  An
    optional method ``with_csr(indptr, indices)`` rebuilds the object's own kind over another
    CSR of its nodes (`datapath.graph.permute` uses it; without it the result is a `CSRGraph`).
    """

    indptr: torch.Tensor
    indices: torch.Tensor

    @property
    def num_src_nodes(self) -> int: ...

    @property
    def num_dst_nodes(self) -> int: ...


@dataclass(eq=False)
class CSRGraph:
    """A bare CSR following the `CSR` protocol (no validation, no placement logic)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src_nodes: int
    num_dst_nodes: int
    trusted: bool = False

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())
