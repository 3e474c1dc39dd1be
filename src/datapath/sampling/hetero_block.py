"""`HeteroBlock`: one layer's typed message-flow graph (per node type src/dst nodes, per relation a local CSR)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EdgeType = tuple[str, str, str]


class RelationBlock:
    """One relation of a `HeteroBlock`: a CSR of destination rows, local ids, following the `datapath.graph.CSR` protocol.

    Attributes:
        indptr: (num_dst_nodes+1,) int64.
        indices: (E,) int64 local source ids in ``[0, num_src_nodes)`` (rows of the source type's ``src_nodes``).
        num_src_nodes / num_dst_nodes: the source type's layer inputs and the destination type's outputs.
        trusted / max_degree: as for `datapath.sampling.Block` (valid by construction; at most the fanout per row).
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, num_src_nodes: int, num_dst_nodes: int,
                 max_degree: int | None = None, trusted: bool = True) -> None:
        self.indptr = indptr
        self.indices = indices
        self.num_src_nodes = int(num_src_nodes)
        self.num_dst_nodes = int(num_dst_nodes)
        self.max_degree = None if max_degree is None else int(max_degree)
        self.trusted = trusted

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    def in_degrees(self) -> torch.Tensor:
        return self.indptr[1:] - self.indptr[:-1]

    def edge_index(self) -> torch.Tensor:
        """(2, E) int64 local ``edge_index``: row 0 source (rows of the source type), row 1 destination."""
        dst = torch.repeat_interleave(torch.arange(self.num_dst_nodes, device=self.indices.device),
                                      self.in_degrees(), output_size=self.num_edges)
        return torch.stack([self.indices, dst])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RelationBlock":
        return RelationBlock(self.indptr.to(device, non_blocking=non_blocking),
                             self.indices.to(device, non_blocking=non_blocking), self.num_src_nodes,
                             self.num_dst_nodes, self.max_degree, self.trusted)

    def __repr__(self) -> str:
        return (f"RelationBlock(num_src_nodes={self.num_src_nodes}, num_dst_nodes={self.num_dst_nodes}, "
                f"num_edges={self.num_edges})")


class HeteroBlock:
    """A sampled typed layer: per node type its source nodes (the first ``num_dst_nodes[t]`` are its destinations,
    DGL's convention), per relation a `RelationBlock`.

    Attributes:
        src_nodes: ``{node_type: (N_t,) int64}`` per-type global ids of the layer's inputs (every node type,
            possibly empty).
        num_dst_nodes: ``{node_type: int}`` destinations per type (``x_dst = x_src[:num_dst_nodes[t]]``).
        relations: ``{edge_type: RelationBlock}`` for every relation whose destination type has destinations.

    Derived data (the relations merged per destination type, compact source sets) is kept in ``derived``
    by `datapath.ops.typed` (the block's arrays never change in place).
    """

    def __init__(self, src_nodes: dict[str, torch.Tensor], num_dst_nodes: dict[str, int],
                 relations: dict[EdgeType, RelationBlock]) -> None:
        self.src_nodes = src_nodes
        self.num_dst_nodes = {t: int(n) for t, n in num_dst_nodes.items()}
        self.relations = relations
        self._derived: dict[Any, Any] = {}

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` computed once for this block and kept under ``key``."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @property
    def node_types(self) -> list[str]:
        return list(self.src_nodes)

    @property
    def edge_types(self) -> list[EdgeType]:
        return list(self.relations)

    @property
    def num_src_nodes(self) -> dict[str, int]:
        return {t: int(v.numel()) for t, v in self.src_nodes.items()}

    @property
    def num_edges(self) -> dict[EdgeType, int]:
        return {et: r.num_edges for et, r in self.relations.items()}

    @property
    def dst_types(self) -> list[str]:
        """Node types with destinations in this layer."""
        return [t for t, n in self.num_dst_nodes.items() if n > 0]

    def dst_nodes(self, t: str) -> torch.Tensor:
        """(num_dst_nodes[t],) int64 global ids of the destinations of type ``t`` (a view of ``src_nodes[t]``)."""
        return self.src_nodes[t][: self.num_dst_nodes.get(t, 0)]

    @property
    def device(self) -> torch.device:
        return next(iter(self.src_nodes.values())).device

    def to_pyg(self) -> dict[EdgeType, torch.Tensor]:
        """PyG's ``edge_index_dict``: ``{edge_type: (2, E) int64}`` in local ids (rows of ``src_nodes[type]``).

        With ``x_dict = {t: x[t][src_nodes[t]]}`` a PyG hetero layer (``HGTConv``, ``to_hetero``) computes
        every type's rows; the first ``num_dst_nodes[t]`` of them are this layer's outputs.
        """
        return {et: r.edge_index() for et, r in self.relations.items()}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "HeteroBlock":
        return HeteroBlock({t: v.to(device, non_blocking=non_blocking) for t, v in self.src_nodes.items()},
                           self.num_dst_nodes,
                           {et: r.to(device, non_blocking) for et, r in self.relations.items()})

    def tensors(self) -> list[torch.Tensor]:
        """The block's tensors (for ``record_stream``)."""
        out = list(self.src_nodes.values())
        for r in self.relations.values():
            out += [r.indptr, r.indices]
        return out

    def __repr__(self) -> str:
        nodes = ", ".join(f"{t}={self.num_dst_nodes.get(t, 0)}/{n}" for t, n in self.num_src_nodes.items())
        return f"HeteroBlock(dst/src: {nodes}; edges={sum(self.num_edges.values())})"
