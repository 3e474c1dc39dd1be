"""`Block`: one layer's message-flow graph from a sampled frontier to its destination nodes."""
from __future__ import annotations

import torch


class Block:
    """A bipartite graph: ``num_src_nodes`` sources, ``num_dst_nodes`` destinations, as a CSR of destination rows.

    Attributes:
        indptr: (num_dst+1,) int64 on the block's device.
        indices: (E,) int64 local source ids in ``[0, num_src_nodes)``.
        src_nodes: (num_src,) int64 global node ids of the sources; the first
            ``num_dst_nodes`` of them are the destinations (DGL's convention), so
            ``x_dst = x_src[:num_dst_nodes]``.
        edge_ids: optional (E,) int64 global edge ids (the sampler's ``return_edge_ids``).
        trusted: True when the CSR is valid by construction (blocks made by
            `NeighborSampler`); `datapath.ops` then skips its index-range check,
            which costs a host synchronisation per block.
        max_degree: optional bound on any destination's edge count (the sampler's fanout of
            the hop).  With ``trusted``, `datapath.ops` plans its kernels by it (no launch for
            long rows where there are none; several short rows per team), so it must hold:
            a row longer than it would be summed in part.

    Follows the `datapath.graph.CSR` protocol.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, src_nodes: torch.Tensor,
                 num_dst_nodes: int, edge_ids: torch.Tensor | None = None, trusted: bool = False,
                 max_degree: int | None = None) -> None:
        self.indptr = indptr
        self.indices = indices
        self.src_nodes = src_nodes
        self.num_dst_nodes = int(num_dst_nodes)
        self.edge_ids = edge_ids
        self.trusted = trusted
        self.max_degree = None if max_degree is None else int(max_degree)

    @property
    def num_src_nodes(self) -> int:
        return int(self.src_nodes.numel())

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def dst_nodes(self) -> torch.Tensor:
        """(num_dst,) int64 global ids of the destination nodes (a view of ``src_nodes``)."""
        return self.src_nodes[: self.num_dst_nodes]

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def in_degrees(self) -> torch.Tensor:
        """(num_dst,) int64 sampled in-degree of each destination."""
        return self.indptr[1:] - self.indptr[:-1]

    def edge_index(self) -> torch.Tensor:
        """(2, E) int64 PyG ``edge_index`` in local ids: row 0 source (in ``[0, num_src)``), row 1 destination.

        Use with ``size=(num_src_nodes, num_dst_nodes)`` (see `to_pyg`).
        """
        dst = torch.repeat_interleave(torch.arange(self.num_dst_nodes, device=self.device),
                                      self.in_degrees(), output_size=self.num_edges)
        return torch.stack([self.indices, dst])

    def to_pyg(self) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(edge_index, (num_src_nodes, num_dst_nodes))`` for PyG bipartite message passing.

        ``conv((x_src, x_src[:num_dst]), edge_index, size=size)`` with PyG's SAGEConv / GATConv.
        """
        return self.edge_index(), (self.num_src_nodes, self.num_dst_nodes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Block":
        """This block with its tensors on ``device``."""
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Block(mv(self.indptr), mv(self.indices), mv(self.src_nodes), self.num_dst_nodes, mv(self.edge_ids),
                     trusted=self.trusted, max_degree=self.max_degree)

    def tensors(self) -> list[torch.Tensor]:
        """The block's tensors (for ``record_stream``)."""
        return [t for t in (self.indptr, self.indices, self.src_nodes, self.edge_ids) if t is not None]

    def __repr__(self) -> str:
        return (f"Block(num_src_nodes={self.num_src_nodes}, num_dst_nodes={self.num_dst_nodes}, "
                f"num_edges={self.num_edges}, device={self.device})")
