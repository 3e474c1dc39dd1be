"""The graph protocol of the ops: a CSR of destination rows, validated once, with cached derived structures.

Any object with ``indptr`` ((num_dst+1,) int32/int64), ``indices`` ((E,) int32/int64
source ids), ``num_src_nodes`` and ``num_dst_nodes`` (ints or zero-argument methods)
is a graph; so is a tuple ``(indptr, indices, num_src_nodes)``.  Blocks follow DGL's
convention: the destination nodes are the first ``num_dst_nodes`` source nodes.

Derived structures (per-edge destination ids, degrees, the transpose CSR used by the
backward pass, scale vectors) are computed once and kept in a ``_datapath_cache``
dict attribute on the graph object when it accepts attributes; a tuple gets a fresh
cache on every call.  The cache is dropped when the CSR tensors are replaced or
modified in place (their data pointer or version counter changes).

A graph whose contents are valid by construction may say so with an attribute
``trusted = True`` (the loaders' sampled blocks do): its shapes, dtypes and devices
are still checked, its index range is not (that check costs a host synchronisation).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from datapath import memory
from datapath.ops.errors import DeviceMismatchError, GraphFormatError, GraphIndexError

log = logging.getLogger("datapath.ops.graph")

_CACHE_ATTR = "_datapath_cache"
_INDEX_DTYPES = (torch.int32, torch.int64)


def _plain_tensor(t: Any, what: str) -> torch.Tensor:
    """``t`` as an ordinary CPU/CUDA tensor (a unified tensor gives its pinned host tensor)."""
    if not isinstance(t, torch.Tensor):
        raise GraphFormatError(f"graph {what} must be a torch.Tensor, got {type(t).__name__}")
    try:
        where = memory.placement_of(t)
    except memory.PlacementError as exc:
        raise DeviceMismatchError(f"graph {what} lives on device {t.device}; move it to 'cpu' or 'cuda'") from exc
    return t if where == "cuda" else memory.host_of(t)


def _int_attr(obj: Any, *names: str) -> int | None:
    for name in names:
        if hasattr(obj, name):
            v = getattr(obj, name)
            if callable(v):
                v = v()
            if isinstance(v, torch.Tensor):
                v = int(v.item())
            return int(v)
    return None


@dataclass(eq=False)
class CSRView:
    """A validated CSR of destination rows: row ``d`` holds the source ids ``indices[indptr[d]:indptr[d+1]]``.

    ``indptr``: (num_dst+1,) int64; ``indices``: (E,) int32 or int64, on the same
    device.  ``cache`` persists on the graph object between calls when possible.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int
    num_dst: int
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """``cache[key]``, computed by ``make()`` on first use."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    # -- derived structures (all cached) -------------------------------------------------
    def in_degrees(self) -> torch.Tensor:
        """(num_dst,) int64: edges per destination row."""
        return self.cached("in_degrees", lambda: self.indptr[1:] - self.indptr[:-1])

    def out_degrees(self) -> torch.Tensor:
        """(num_src,) int64: edges per source node."""
        def make() -> torch.Tensor:
            # scatter-add, not bincount: bincount sizes its output from the data (a host sync) on CUDA
            ones = torch.ones(self.num_edges, dtype=torch.int64, device=self.device)
            return torch.zeros(self.num_src, dtype=torch.int64, device=self.device).index_add_(
                0, self.indices64(), ones)
        return self.cached("out_degrees", make)

    def edge_dst(self) -> torch.Tensor:
        """(E,) int64: the destination row of every edge (COO row ids)."""
        def make() -> torch.Tensor:
            rows = torch.arange(self.num_dst, device=self.device)
            return torch.repeat_interleave(rows, self.in_degrees(), output_size=self.num_edges)
        return self.cached("edge_dst", make)

    def indices64(self) -> torch.Tensor:
        """(E,) int64 source ids."""
        if self.indices.dtype == torch.int64:
            return self.indices
        return self.cached("indices64", lambda: self.indices.long())

    def transpose(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The CSR of source rows: ``(t_indptr (num_src+1,) int64, t_indices (E,) dst ids, t_perm (E,) int64)``.

        ``t_perm[k]`` is the position in the original CSR of the k-th transposed edge;
        within a source row the destinations keep their original order (stable sort).
        """
        def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            perm = torch.sort(self.indices64(), stable=True).indices
            t_indices = self.edge_dst()[perm].to(self.indices.dtype)
            t_indptr = torch.zeros(self.num_src + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(self.out_degrees(), 0, out=t_indptr[1:])
            return t_indptr, t_indices, perm
        return self.cached("transpose", make)

    def row_scale(self, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(num_dst,) per-row factor: ``"mean"`` 1/max(deg,1); ``"gcn"`` 1/sqrt(max(deg,1))."""
        def make() -> torch.Tensor:
            deg = self.in_degrees().clamp(min=1).to(dtype)
            return deg.reciprocal() if kind == "mean" else deg.rsqrt()
        return self.cached(f"row_scale_{kind}_{dtype}", make)

    def col_scale_gcn(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(num_src,) 1/sqrt(max(out_degree,1)), the source half of GCN's symmetric norm."""
        return self.cached(f"col_scale_gcn_{dtype}", lambda: self.out_degrees().clamp(min=1).to(dtype).rsqrt())


def _unpack(graph: Any) -> tuple[Any, Any, int | None, int | None, dict[str, Any] | None]:
    if isinstance(graph, tuple):
        if len(graph) != 3:
            raise GraphFormatError(
                f"a tuple graph must be (indptr, indices, num_src_nodes); got a tuple of {len(graph)} items"
            )
        indptr, indices, num_src = graph
        return indptr, indices, int(num_src), None, None
    if not (hasattr(graph, "indptr") and hasattr(graph, "indices")):
        raise GraphFormatError(
            f"{type(graph).__name__} is not a graph: it needs `indptr` and `indices` attributes "
            f"(a CSR of destination rows), or pass a tuple (indptr, indices, num_src_nodes)"
        )
    num_src = _int_attr(graph, "num_src_nodes", "num_nodes")
    num_dst = _int_attr(graph, "num_dst_nodes", "num_nodes")
    cache = getattr(graph, _CACHE_ATTR, None)
    if not isinstance(cache, dict):
        cache = {}
        try:
            setattr(graph, _CACHE_ATTR, cache)
        except (AttributeError, TypeError):
            cache = None
    return graph.indptr, graph.indices, num_src, num_dst, cache


def _validate(indptr: torch.Tensor, indices: torch.Tensor, num_src: int, num_dst: int,
              values: bool = True) -> None:
    """Check the CSR's shapes, dtypes and devices; with ``values``, also its contents (one host sync)."""
    if indptr.dim() != 1 or indices.dim() != 1:
        raise GraphFormatError(
            f"indptr and indices must be 1-D, got shapes {tuple(indptr.shape)} and {tuple(indices.shape)}"
        )
    if indptr.dtype not in _INDEX_DTYPES or indices.dtype not in _INDEX_DTYPES:
        raise GraphFormatError(
            f"indptr and indices must be int32 or int64, got {indptr.dtype} and {indices.dtype}"
        )
    if indptr.device != indices.device:
        raise DeviceMismatchError(f"indptr is on {indptr.device} but indices on {indices.device}; move both")
    if indptr.numel() != num_dst + 1:
        raise GraphFormatError(
            f"indptr has {indptr.numel()} entries but num_dst_nodes is {num_dst}: it needs num_dst_nodes+1"
        )
    if num_src < 0 or num_dst < 0:
        raise GraphFormatError(f"negative node counts: num_src_nodes={num_src}, num_dst_nodes={num_dst}")
    if indices.numel() >= 2**31 - 1 and indices.dtype == torch.int32:
        raise GraphFormatError("more than 2^31-1 edges need int64 indices")
    if not values:
        return
    # one host sync for all scalar checks
    e = indices.numel()
    checks = [indptr[0], indptr[-1]]
    if num_dst > 0:
        checks.append((indptr[1:] - indptr[:-1]).min())
    if e > 0:
        checks += [indices.min(), indices.max()]
    vals = torch.stack([c.to(torch.int64) for c in checks]).tolist()
    if vals[0] != 0 or vals[1] != e:
        raise GraphFormatError(
            f"indptr must start at 0 and end at len(indices)={e}; it runs from {vals[0]} to {vals[1]}"
        )
    if num_dst > 0 and vals[2] < 0:
        raise GraphFormatError("indptr must be non-decreasing (a row has a negative length)")
    if e > 0:
        lo, hi = vals[-2], vals[-1]
        if lo < 0 or hi >= num_src:
            raise GraphIndexError(
                f"graph indices range over [{lo}, {hi}] but num_src_nodes is {num_src}; "
                f"every source id must lie in [0, num_src_nodes)"
            )


def as_csr(graph: Any) -> CSRView:
    """Validate ``graph`` (see the module docstring) and return its `CSRView` (cached on the graph)."""
    if isinstance(graph, CSRView):
        return graph
    indptr, indices, num_src, num_dst, cache = _unpack(graph)
    indptr = _plain_tensor(indptr, "indptr")
    indices = _plain_tensor(indices, "indices")
    if num_dst is None:
        num_dst = indptr.numel() - 1
    if num_src is None:
        raise GraphFormatError(
            f"{type(graph).__name__} has no num_src_nodes (or num_nodes); the ops need the source count"
        )
    sig = (indptr.data_ptr(), indices.data_ptr(), indptr._version, indices._version,
           tuple(indptr.shape), tuple(indices.shape), indptr.device, num_src, num_dst)
    if cache is not None and cache.get("_sig") == sig:
        view = cache.get("_view")
        if view is not None:
            return view
    # a graph that declares ``trusted = True`` (the loaders' sampled blocks) is valid by construction:
    # its contents are not re-checked, which would cost a host synchronisation per block
    _validate(indptr, indices, num_src, num_dst, values=not getattr(graph, "trusted", False))
    if indptr.dtype != torch.int64:
        indptr = indptr.long()
    if cache is None:
        return CSRView(indptr, indices, num_src, num_dst)
    cache.clear()
    view = CSRView(indptr, indices, num_src, num_dst, cache)
    cache["_sig"] = sig
    cache["_view"] = view
    return view


@dataclass(eq=False)
class CSRGraph:
    """A minimal graph object following the ops' protocol (it can carry a ``_datapath_cache``)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src_nodes: int
    num_dst_nodes: int


def add_self_loops(graph: Any) -> CSRGraph:
    """The graph with an edge ``d -> d`` appended to every destination row ``d`` (cached on ``graph``).

    Needs ``num_dst_nodes <= num_src_nodes`` (destinations are the first sources).
    Returns a `CSRGraph` (indptr int64, indices of the input dtype) on the graph's device.
    """
    csr = as_csr(graph)
    if csr.num_dst > csr.num_src:
        raise GraphFormatError(
            f"self-loops need destination nodes among the sources, but num_dst_nodes={csr.num_dst} "
            f"> num_src_nodes={csr.num_src}"
        )

    def make() -> CSRGraph:
        dev = csr.device
        deg = csr.in_degrees()
        new_ptr = torch.zeros_like(csr.indptr)
        torch.cumsum(deg + 1, 0, out=new_ptr[1:])
        e = csr.num_edges + csr.num_dst
        new_idx = torch.empty(e, dtype=csr.indices.dtype, device=dev)
        # old edge k of row d moves to k + d; the loop of row d goes to new_ptr[d+1]-1
        pos = torch.arange(csr.num_edges, device=dev) + csr.edge_dst()
        new_idx[pos] = csr.indices
        rows = torch.arange(csr.num_dst, device=dev)
        new_idx[new_ptr[1:] - 1] = rows.to(csr.indices.dtype)
        return CSRGraph(new_ptr, new_idx, csr.num_src, csr.num_dst)
    return csr.cached("with_self_loops", make)
