"""`Graph`: a CSR of in-neighbours held in cpu, unified or cuda memory.

Row ``v`` lists the source nodes of the edges ``u -> v``: ``indices[indptr[v]:indptr[v+1]]``
(DGL calls this CSC of the adjacency; the message-passing direction is src -> dst).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath.graph._files import load_npy, save_json, save_npy
from datapath.graph.errors import DatasetError, InvalidGraphError
from datapath.graph.reordering import reorder as reorder_graph
from datapath.memory import PLACEMENTS, host_of, placement_of, to_placement

log = logging.getLogger("datapath.graph")

_INDEX_DTYPES = (torch.int32, torch.int64)
_NPY_FILES = ("indptr.npy", "indices.npy")


def _as_index_tensor(a: Any, what: str) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        if a.dtype not in (np.int32, np.int64):
            raise InvalidGraphError(f"{what} must be int32 or int64, got numpy {a.dtype}; cast it first")
        a = torch.from_numpy(a)
    if not isinstance(a, torch.Tensor):
        raise InvalidGraphError(f"{what} must be a torch.Tensor or numpy array, got {type(a).__name__}")
    if a.dtype not in _INDEX_DTYPES:
        raise InvalidGraphError(f"{what} must be int32 or int64, got {a.dtype}")
    if a.dim() != 1:
        raise InvalidGraphError(f"{what} must be 1-D, got shape {tuple(a.shape)}")
    return a


def validate_csr(indptr: torch.Tensor, indices: torch.Tensor, num_src_nodes: int,
                 edge_ids: torch.Tensor | None = None) -> None:
    """Raise `InvalidGraphError` unless (indptr, indices) is a well-formed CSR over ``num_src_nodes`` sources.

    Checks shapes and dtypes, ``indptr[0] == 0``, ``indptr[-1] == len(indices)``,
    non-decreasing ``indptr``, and every index in ``[0, num_src_nodes)``; one host
    sync for all the value checks.
    """
    if indptr.numel() < 1:
        raise InvalidGraphError("indptr must have num_nodes+1 >= 1 entries, got an empty tensor")
    if num_src_nodes < 0:
        raise InvalidGraphError(f"num_src_nodes must be >= 0, got {num_src_nodes}")
    e = indices.numel()
    if edge_ids is not None and edge_ids.numel() != e:
        raise InvalidGraphError(f"edge_ids has {edge_ids.numel()} entries but there are {e} edges")
    if indices.dtype == torch.int32 and num_src_nodes > 2**31 - 1:
        raise InvalidGraphError(f"{num_src_nodes} nodes need int64 indices")
    if indptr.dtype == torch.int32 and e > 2**31 - 1:
        raise InvalidGraphError(f"{e} edges need an int64 indptr")
    ptr = host_of(indptr) if placement_of(indptr) == "unified" else indptr
    idx = host_of(indices) if placement_of(indices) == "unified" else indices
    checks = [ptr[0].long(), ptr[-1].long()]
    if ptr.numel() > 1:
        checks.append((ptr[1:] - ptr[:-1]).min().long())
    if e > 0:
        lo, hi = torch.aminmax(idx)
        checks += [lo.long().to(ptr.device), hi.long().to(ptr.device)]
    vals = torch.stack([c.to(checks[0].device) for c in checks]).tolist()
    if vals[0] != 0 or vals[1] != e:
        raise InvalidGraphError(
            f"indptr must start at 0 and end at len(indices)={e}; it runs from {vals[0]} to {vals[1]}"
        )
    if ptr.numel() > 1 and vals[2] < 0:
        raise InvalidGraphError("indptr must be non-decreasing: some row has a negative length")
    if e > 0 and (vals[-2] < 0 or vals[-1] >= num_src_nodes):
        raise InvalidGraphError(
            f"indices range over [{vals[-2]}, {vals[-1]}] but there are {num_src_nodes} source nodes; "
            f"every index must lie in [0, {num_src_nodes})"
        )


def by_destination(src: torch.Tensor, dst: torch.Tensor, num_dst: int, num_src: int, *,
                   keep_edge_ids: bool = False) -> "Graph":
    """The `Graph` of the edges ``src[i] -> dst[i]`` (int64, ids already checked), grouped by destination.

    A stable sort, so parallel edges keep their order; ``indices`` is int32 below 2**31 sources.
    With ``keep_edge_ids`` the graph remembers each edge's position ``i``.  Lives where ``dst`` lives.
    """
    order = torch.sort(dst, stable=True).indices
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64, device=dst.device)
    torch.cumsum(torch.bincount(dst, minlength=num_dst), 0, out=indptr[1:])
    idx_dtype = torch.int32 if num_src < 2**31 else torch.int64
    return Graph(indptr, src[order].to(idx_dtype), edge_ids=order if keep_edge_ids else None,
                 num_src_nodes=num_src, validate=False)


class Graph:
    """A directed graph as the CSR of in-neighbours, in ``"cpu"``, ``"unified"`` or ``"cuda"`` memory.

    Attributes:
        indptr: (num_nodes+1,) int32/int64, non-decreasing from 0 to num_edges.
        indices: (num_edges,) int32/int64 source node ids, in ``[0, num_src_nodes)``.
        edge_ids: optional (num_edges,) int64 ids of the edges (default: the CSR position).
        num_src_nodes / num_dst_nodes: node counts (equal, ``num_nodes``, for an ordinary graph).

    Follows the `datapath.graph.CSR` protocol, so `datapath.ops` and the samplers take it
    directly.  Facts derived from the arrays (the largest degree, kernel views of unified
    memory) are computed once and kept with the graph (`derived`).
    """

    def __init__(self, indptr: Any, indices: Any, *, edge_ids: Any = None,
                 num_src_nodes: int | None = None, validate: bool = True) -> None:
        indptr = _as_index_tensor(indptr, "indptr")
        indices = _as_index_tensor(indices, "indices")
        if edge_ids is not None:
            edge_ids = _as_index_tensor(edge_ids, "edge_ids")
        # an empty array holds no bytes (pinned memory of 0 bytes is not pinned): only the others must agree
        where = {placement_of(t) for t in (indptr, indices, edge_ids) if t is not None and (t is indptr or t.numel())}
        if len(where) != 1:
            raise InvalidGraphError(f"indptr, indices and edge_ids must live in one memory, got {sorted(where)}")
        n = indptr.numel() - 1
        num_src = n if num_src_nodes is None else int(num_src_nodes)
        if validate:
            validate_csr(indptr, indices, num_src, edge_ids)
        self.indptr = indptr
        self.indices = indices
        self.edge_ids = edge_ids
        self.num_src_nodes = num_src
        self.num_dst_nodes = n
        self._derived: dict[str, Any] = {}

    def derived(self, key: str, make: Any) -> Any:
        """``make()`` computed once for this graph and kept under ``key`` (the arrays never change in place)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def max_in_degree(self) -> int:
        """The largest in-degree (computed once; a host read of ``indptr``)."""
        return self.derived("max_in_degree",
                            lambda: int(self.in_degrees().max().item()) if self.num_nodes else 0)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_csr(cls, indptr: Any, indices: Any, **kw: Any) -> "Graph":
        """Same as ``Graph(indptr, indices, ...)``."""
        return cls(indptr, indices, **kw)

    @classmethod
    def from_edge_index(cls, edge_index: Any, num_nodes: int | None = None, *,
                        keep_edge_ids: bool = False) -> "Graph":
        """From a PyG-style ``edge_index`` (2, E): row 0 source, row 1 destination (messages flow src -> dst).

        Edges are grouped by destination (stable, so parallel edges keep their order);
        with ``keep_edge_ids`` the graph remembers each edge's column in ``edge_index``.
        The result lives where ``edge_index`` lives (cpu or cuda).
        """
        ei = torch.as_tensor(edge_index)
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise InvalidGraphError(f"edge_index must have shape (2, E), got {tuple(ei.shape)}")
        if ei.dtype not in _INDEX_DTYPES:
            raise InvalidGraphError(f"edge_index must be int32 or int64, got {ei.dtype}")
        src, dst = ei[0].long(), ei[1].long()
        if num_nodes is None:
            num_nodes = int(ei.max().item()) + 1 if ei.numel() else 0
        if ei.numel():
            lo, hi = (int(v) for v in torch.aminmax(ei))
            if lo < 0 or hi >= num_nodes:
                raise InvalidGraphError(f"edge_index values range over [{lo}, {hi}] but num_nodes is {num_nodes}")
        return by_destination(src, dst, num_nodes, num_nodes, keep_edge_ids=keep_edge_ids)

    @classmethod
    def from_scipy(cls, matrix: Any) -> "Graph":
        """From a scipy sparse matrix ``A`` whose row ``i`` lists the in-neighbours of ``i``.

        ``A[i, j] != 0`` is an edge ``j -> i``; for PyG's convention (``A[src, dst]``) pass ``A.T``.
        A non-square matrix gives a bipartite graph with ``A.shape[1]`` source nodes.
        """
        from datapath._runtime.optional import require  # noqa: PLC0415

        sp = require("scipy.sparse", extra="io", purpose="Graph.from_scipy")

        if not sp.issparse(matrix):
            raise InvalidGraphError(f"expected a scipy sparse matrix, got {type(matrix).__name__}")
        csr = sp.csr_matrix(matrix)
        csr.sort_indices()
        indptr = np.ascontiguousarray(csr.indptr).astype(np.int64, copy=False)
        indices = np.ascontiguousarray(csr.indices)
        if indices.dtype not in (np.int32, np.int64):
            indices = indices.astype(np.int64)
        return cls(torch.from_numpy(indptr), torch.from_numpy(indices), num_src_nodes=csr.shape[1])

    @classmethod
    def from_pyg(cls, data: Any) -> "Graph":
        """From a PyTorch Geometric ``Data`` (its ``edge_index`` and ``num_nodes``): row ``v`` lists the sources
        of the edges into ``v``; see `from_edge_index`."""
        ei = getattr(data, "edge_index", None)
        if ei is None:
            raise DatasetError(f"{type(data).__name__} has no edge_index; expected a torch_geometric.data.Data")
        return cls.from_edge_index(ei.cpu(), num_nodes=int(data.num_nodes))

    @classmethod
    def from_dgl(cls, g: Any) -> "Graph":
        """From a homogeneous DGL graph (``g.edges()``: sources, destinations); see `from_edge_index`."""
        if len(getattr(g, "ntypes", ())) > 1 or len(getattr(g, "canonical_etypes", ())) > 1:
            raise DatasetError("a heterogeneous DGL graph: convert it with dgl.to_homogeneous first")
        src, dst = g.edges()
        return cls.from_edge_index(torch.stack([src.cpu(), dst.cpu()]), num_nodes=int(g.num_nodes()))

    # -- files ----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``indptr.npy``, ``indices.npy`` (and ``edge_ids.npy``) plus ``graph.json`` into ``directory``.

        Each file is written under a temporary name and renamed into place, so a crash never
        leaves a half-written array (`datapath.graph.Dataset.save` makes the whole directory atomic).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_npy(d / "indptr.npy", host_of(self.indptr).cpu().numpy())
        save_npy(d / "indices.npy", host_of(self.indices).cpu().numpy())
        if self.edge_ids is not None:
            save_npy(d / "edge_ids.npy", host_of(self.edge_ids).cpu().numpy())
        save_json(d / "graph.json", {"num_src_nodes": self.num_src_nodes, "num_dst_nodes": self.num_dst_nodes,
                                     "num_edges": self.num_edges})
        return d

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = True, validate: bool = True) -> "Graph":
        """Load a graph written by `save` (memory-mapped by default: nothing is read until used).

        The arrays are mapped copy-on-write: writing to the tensors never touches the
        files, and ``datapath.unified_tensor.as_unified`` can pin them in place.  A missing,
        truncated or corrupt file raises `DatasetError` naming it.
        """
        d = Path(directory)
        missing = [f for f in _NPY_FILES if not (d / f).is_file()]
        if missing:
            raise DatasetError(f"{d} is not a graph directory: missing {', '.join(missing)}")
        indptr = load_npy(d / "indptr.npy", mmap)
        indices = load_npy(d / "indices.npy", mmap)
        eids = load_npy(d / "edge_ids.npy", mmap) if (d / "edge_ids.npy").is_file() else None
        num_src = None
        if (d / "graph.json").is_file():
            try:
                num_src = json.loads((d / "graph.json").read_text()).get("num_src_nodes")
            except (ValueError, AttributeError) as exc:
                raise DatasetError(f"{d / 'graph.json'} is not valid JSON ({exc}); re-create the graph") from exc
        return cls(indptr, indices, edge_ids=eids, num_src_nodes=num_src, validate=validate)

    # -- placement -------------------------------------------------------------------------
    @property
    def placement(self) -> str:
        """``"cpu"``, ``"unified"`` or ``"cuda"`` (of ``indptr``, which is never empty)."""
        return placement_of(self.indptr)

    @property
    def device(self) -> torch.device:
        """The torch device of the CSR tensors (``unified`` tensors report their own device)."""
        return self.indices.device

    def to(self, where: str) -> "Graph":
        """A graph in ``where`` (``"cpu"``, ``"unified"``, ``"cuda"``); ``self`` when it is already there.

        ``"unified"`` copies the arrays into pinned, GPU-mapped host memory (plain host
        memory without CUDA).  To pin in place instead, build the graph from
        ``datapath.unified_tensor.as_unified`` tensors.
        """
        if where not in PLACEMENTS:
            raise InvalidGraphError(f"a graph can live in {PLACEMENTS}, not {where!r}")
        if where == self.placement:
            return self
        move = lambda t: None if t is None else to_placement(t, where)  # noqa: E731
        g = Graph(move(self.indptr), move(self.indices), edge_ids=move(self.edge_ids),
                  num_src_nodes=self.num_src_nodes, validate=False)
        return g

    def reorder(self, method: str = "degree") -> "tuple[Graph, torch.Tensor]":
        """This graph renumbered for locality (`datapath.graph.reorder`): ``(new_graph, perm)`` with
        ``perm[new_id] = old_id``; ``"degree"``, ``"rcm"`` or ``"community"``."""
        return reorder_graph(self, method)

    def with_csr(self, indptr: torch.Tensor, indices: torch.Tensor) -> "Graph":
        """A `Graph` over ``indptr``/``indices``, another CSR of this graph's nodes (a renumbering of it: see
        `datapath.graph.permute`), in their memory; edge ids are not carried over.  Validated."""
        return Graph(indptr, indices, num_src_nodes=self.num_src_nodes)

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Number of (destination) nodes."""
        return self.num_dst_nodes

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    def in_degrees(self) -> torch.Tensor:
        """(num_nodes,) int64 in-degrees, on the CSR's device (host for unified)."""
        ptr = host_of(self.indptr) if self.placement == "unified" else self.indptr
        return (ptr[1:] - ptr[:-1]).long()

    def edge_index(self) -> torch.Tensor:
        """(2, E) int64 PyG ``edge_index`` (row 0 source, row 1 destination), in CSR order."""
        ptr = host_of(self.indptr) if self.placement == "unified" else self.indptr
        idx = host_of(self.indices) if self.placement == "unified" else self.indices
        dst = torch.repeat_interleave(torch.arange(self.num_dst_nodes, device=ptr.device),
                                      (ptr[1:] - ptr[:-1]).long(), output_size=self.num_edges)
        return torch.stack([idx.long(), dst])

    def __repr__(self) -> str:
        return (f"Graph(num_nodes={self.num_dst_nodes}, num_edges={self.num_edges}, "
                f"placement={self.placement!r}, indptr={self.indptr.dtype}, indices={self.indices.dtype})")
