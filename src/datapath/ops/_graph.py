"""How the ops read a graph: the `datapath.graph.CSR` protocol, validated once, with per-graph derived data.

Any object with ``indptr`` ((num_dst+1,) int32/int64), ``indices`` ((E,) int32/int64
source ids), ``num_src_nodes`` and ``num_dst_nodes`` (ints or zero-argument methods)
is a graph (`datapath.graph.Graph`, `datapath.sampling.Block`, `datapath.graph.CSRGraph`);
so is a tuple ``(indptr, indices, num_src_nodes)``.  Blocks follow DGL's convention:
the destination nodes are the first ``num_dst_nodes`` source nodes.

The ops never set attributes on the caller's graph.  Its validated view (`CSRView`) and
everything derived from it (degrees, the transposed CSR of the backward pass, kernel
schedules, the chosen kernel plans) live in a cache keyed weakly by the graph object,
so they go away with the graph.  The view is rebuilt when the CSR tensors are replaced
or modified in place (their data pointer or version counter changes).  A tuple cannot
be weakly referenced: it is validated on every call.

A graph whose contents are valid by construction may say so with ``trusted = True``
(the samplers' blocks do): its shapes, dtypes and devices are still checked, its values
are not (that check costs a host synchronisation); a ``max_degree`` attribute it carries
(the samplers' fanout) is taken as the bound on its row length, unchecked.  Any other graph is checked once:
``indptr`` starts at 0, never decreases and ends at E, every index lies in
``[0, num_src_nodes)``; the largest row length is noted on the way (the kernels use it).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from datapath import memory
from datapath.graph import CSRGraph
from datapath.ops import _checks
from datapath.ops.errors import DeviceMismatchError, GraphFormatError, GraphIndexError

_INDEX_DTYPES = (torch.int32, torch.int64)
_VIEWS: "weakref.WeakKeyDictionary[Any, tuple[tuple, CSRView]]" = weakref.WeakKeyDictionary()
_VIEWS_LOCK = threading.Lock()


def _plain_tensor(t: Any, what: str) -> torch.Tensor:
    """``t`` as an ordinary CPU/CUDA tensor (a unified tensor gives its pinned host tensor)."""
    if not isinstance(t, torch.Tensor):
        raise GraphFormatError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda":
        return t
    try:
        where = memory.placement_of(t)
    except memory.PlacementError as exc:
        raise DeviceMismatchError(f"{what} lives on device {t.device}; move it to 'cpu' or 'cuda'") from exc
    return t if where == "cuda" else memory.host_of(t)


def _count(obj: Any, name: str) -> int | None:
    v = getattr(obj, name, None)
    if v is None:
        return None
    if callable(v):
        v = v()
    if isinstance(v, torch.Tensor):
        v = int(v.item())
    return int(v)


class Ref:
    """A cache-key part standing for one object itself (a tensor, say): hashed by its identity, equal only to a
    `Ref` of the same object, and holding it, so that while the key lives its id cannot pass to a new object
    (a bare ``id()`` or ``data_ptr()`` in a key can: a freed tensor's successor may land at its address).  For
    keys of caches kept with the object's owner (a view's cache keyed by the view's own scale vectors)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Ref({type(self.obj).__name__} at {id(self.obj):#x})"


@dataclass(eq=False)
class CSRView:
    """A validated CSR of destination rows: row ``d`` holds the source ids ``indices[indptr[d]:indptr[d+1]]``.

    Attributes:
        indptr: (num_dst+1,) int64.
        indices: (E,) int32 or int64, on indptr's device.
        num_src, num_dst: node counts.
        trusted: the contents were not checked (the graph vouched for them).
        max_degree: the largest row length when known (checked graphs), else None.
        edge_perm: for the transposed view of a graph, (E,) int64: the original CSR position of
            each of its edges; None for a graph's own view.
        cache: derived data (`cached`); lives as long as the graph object.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int
    num_dst: int
    trusted: bool = False
    max_degree: int | None = None
    edge_perm: torch.Tensor | None = None
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``cache[key]``, computed by ``make()`` on first use."""
        v = self.cache.get(key)
        if v is None:
            v = self.cache[key] = make()
        return v

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

    def transposed(self) -> CSRView:
        """The CSR of source rows (built once), as a view of its own.

        Row ``s`` lists the destinations of source ``s`` in their original order (stable sort);
        its ``edge_perm[k]`` is the original CSR position of its k-th edge.  The gradient of an
        aggregation with respect to its input is an aggregation over this view.  Built without
        a host synchronisation, except for a graph the ops checked themselves (not ``trusted``: it
        waited for its check already), whose longest source row is read too (the row-split kernel
        then needs no tail blocks or long-row buffer when there are none).
        """
        def make() -> CSRView:
            perm = torch.sort(self.indices64(), stable=True).indices
            t_indices = self.edge_dst().index_select(0, perm).to(self.indices.dtype)
            t_indptr = torch.zeros(self.num_src + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(self.out_degrees(), 0, out=t_indptr[1:])
            longest = None if self.trusted or self.num_src == 0 else int(self.out_degrees().max())
            return CSRView(t_indptr, t_indices, self.num_dst, self.num_src, trusted=True, max_degree=longest,
                           edge_perm=perm)
        return self.cached("transposed", make)

    def row_scale(self, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(num_dst,) per-row factor: ``"mean"`` 1/max(deg,1); ``"gcn"`` 1/sqrt(max(deg,1))."""
        def make() -> torch.Tensor:
            deg = self.in_degrees().clamp(min=1).to(dtype)
            return deg.reciprocal() if kind == "mean" else deg.rsqrt()
        return self.cached(("row_scale", kind, dtype), make)

    def col_scale_gcn(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(num_src,) 1/sqrt(max(out_degree,1)), the source half of GCN's symmetric norm."""
        return self.cached(("col_scale_gcn", dtype),
                           lambda: self.out_degrees().clamp(min=1).to(dtype).rsqrt())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the view and of its cache (for ``record_stream`` by a caller on another stream)."""
        out: list[torch.Tensor] = [self.indptr, self.indices]
        if self.edge_perm is not None:
            out.append(self.edge_perm)
        seen: set[int] = set()

        def walk(v: Any) -> None:
            if id(v) in seen:
                return
            seen.add(id(v))
            if isinstance(v, torch.Tensor):  # a CSR matrix (cuSPARSE's) by its parts: record_stream takes those
                out.extend((v.crow_indices(), v.col_indices(), v.values()) if v.layout == torch.sparse_csr else (v,))
            elif isinstance(v, (tuple, list)):
                for u in v:
                    walk(u)
            elif isinstance(v, CSRView):
                out.extend(v.tensors())
            elif hasattr(v, "tensors") and callable(v.tensors):
                out.extend(v.tensors())
        for v in self.cache.values():
            walk(v)
        return out


def _unpack(graph: Any) -> tuple[Any, Any, int | None, int | None]:
    if isinstance(graph, tuple):
        if len(graph) != 3:
            raise GraphFormatError(
                f"a tuple graph must be (indptr, indices, num_src_nodes); got a tuple of {len(graph)} items"
            )
        indptr, indices, num_src = graph
        return indptr, indices, int(num_src), None
    if not (hasattr(graph, "indptr") and hasattr(graph, "indices")):
        raise GraphFormatError(
            f"{type(graph).__name__} is not a graph: it needs `indptr` and `indices` attributes "
            f"(a CSR of destination rows, see datapath.graph.CSR), or pass a tuple (indptr, indices, num_src_nodes)"
        )
    num_src = _count(graph, "num_src_nodes")
    if num_src is None:
        num_src = _count(graph, "num_nodes")
    num_dst = _count(graph, "num_dst_nodes")
    if num_dst is None:
        num_dst = _count(graph, "num_nodes")
    return graph.indptr, graph.indices, num_src, num_dst


def _check_layout(indptr: torch.Tensor, indices: torch.Tensor, num_src: int, num_dst: int) -> None:
    """Shapes, dtypes and devices of the CSR (no synchronisation)."""
    if indptr.dim() != 1 or indices.dim() != 1:
        raise GraphFormatError(
            f"graph.indptr and graph.indices must be 1-D, got shapes {tuple(indptr.shape)} and "
            f"{tuple(indices.shape)}"
        )
    if indptr.dtype not in _INDEX_DTYPES:
        raise GraphFormatError(f"graph.indptr must be int32 or int64, got {indptr.dtype}")
    if indices.dtype not in _INDEX_DTYPES:
        raise GraphFormatError(f"graph.indices must be int32 or int64, got {indices.dtype}")
    if indptr.device != indices.device:
        raise DeviceMismatchError(
            f"graph.indptr is on {indptr.device} but graph.indices on {indices.device}; move both to one device"
        )
    if num_src < 0 or num_dst < 0:
        raise GraphFormatError(f"negative node counts: num_src_nodes={num_src}, num_dst_nodes={num_dst}")
    if indptr.numel() != num_dst + 1:
        raise GraphFormatError(
            f"graph.indptr has {indptr.numel()} entries but num_dst_nodes is {num_dst}: it needs num_dst_nodes+1"
        )
    if indices.numel() >= 2**31 - 1 and indices.dtype == torch.int32:
        raise GraphFormatError("more than 2^31-1 edges need int64 graph.indices")


def _check_values(indptr: torch.Tensor, indices: torch.Tensor, num_src: int, num_dst: int) -> int:
    """Check the CSR's values (one host synchronisation for all of them); returns the largest row length."""
    e = indices.numel()
    checks = [indptr[0], indptr[-1]]
    if num_dst > 0:
        d = indptr[1:] - indptr[:-1]
        checks += [d.min(), d.max()]
    if e > 0:
        lo, hi = torch.aminmax(indices)
        checks += [lo, hi]
    vals = torch.stack([c.to(torch.int64) for c in checks]).tolist()
    if vals[0] != 0 or vals[1] != e:
        raise GraphFormatError(
            f"graph.indptr must start at 0 and end at len(graph.indices)={e}; it runs from {vals[0]} to {vals[1]}"
        )
    if num_dst > 0 and vals[2] < 0:
        raise GraphFormatError("graph.indptr must be non-decreasing (sorted): a row has a negative length")
    if e > 0:
        lo, hi = vals[-2], vals[-1]
        if lo < 0 or hi >= num_src:
            raise GraphIndexError(
                f"graph.indices range over [{lo}, {hi}] but num_src_nodes is {num_src}; "
                f"every source id must lie in [0, num_src_nodes)"
            )
    return int(vals[3]) if num_dst > 0 else 0


def as_csr(graph: Any) -> CSRView:
    """Validate ``graph`` (see the module docstring) and return its `CSRView` (cached per graph object)."""
    if isinstance(graph, CSRView):
        return graph
    weak = not isinstance(graph, tuple)
    if weak:  # the hot path: the same graph object, its tensors untouched (identity and version counters)
        try:
            hit = _VIEWS.get(graph)
        except TypeError:  # not weakly referenceable
            hit, weak = None, False
        if hit is not None:
            sig, view = hit
            ip, ix = getattr(graph, "indptr", None), getattr(graph, "indices", None)
            if (ip is sig[0] and ix is sig[1] and ip._version == sig[2] and ix._version == sig[3]
                    and _num_src(graph) == view.num_src and _num_dst(graph, view.num_dst) == view.num_dst):
                return view
    raw_ptr, raw_idx, num_src, num_dst = _unpack(graph)
    indptr = _plain_tensor(raw_ptr, "graph.indptr")
    indices = _plain_tensor(raw_idx, "graph.indices")
    if num_dst is None:
        num_dst = indptr.numel() - 1
    if num_src is None:
        raise GraphFormatError(
            f"{type(graph).__name__} has no num_src_nodes (or num_nodes); the ops need the source count"
        )
    _check_layout(indptr, indices, num_src, num_dst)
    trusted = bool(getattr(graph, "trusted", False))
    if trusted:  # its maker vouches for its values, and for its bound on the row length if it gives one
        hint = getattr(graph, "max_degree", None)
        max_degree = int(hint) if isinstance(hint, int) and not isinstance(hint, bool) and hint >= 0 else None
        if _checks.debug_checks_enabled():  # debug mode: what the maker vouches for is checked too
            longest = _check_values(indptr, indices, num_src, num_dst)
            if max_degree is not None and longest > max_degree:
                raise GraphFormatError(
                    f"{type(graph).__name__} says no row is longer than max_degree={max_degree}, but one has "
                    f"{longest} edges; the kernels planned by that bound would sum such a row in part")
    else:
        max_degree = _check_values(indptr, indices, num_src, num_dst)
    if indptr.dtype != torch.int64:
        indptr = indptr.long()
    view = CSRView(indptr, indices, num_src, num_dst, trusted=trusted, max_degree=max_degree)
    if weak:
        with _VIEWS_LOCK:
            _VIEWS[graph] = ((raw_ptr, raw_idx, raw_ptr._version, raw_idx._version), view)
    return view


def _num_src(graph: Any) -> int | None:
    n = _count(graph, "num_src_nodes")
    return _count(graph, "num_nodes") if n is None else n


def _num_dst(graph: Any, default: int) -> int:
    n = _count(graph, "num_dst_nodes")
    if n is None:
        n = _count(graph, "num_nodes")
    return default if n is None else n


def cached_keys(graph: Any) -> list[Any]:
    """What the ops have derived and kept for ``graph`` so far (its view's cache keys; [] if none).

    For inspection and tests: e.g. whether a loader's ``prepare`` hook built a block's
    schedules before the training step ran.
    """
    try:
        hit = _VIEWS.get(graph)
    except TypeError:
        return []
    if hit is None:
        return []
    view = hit[1]
    keys = list(view.cache)
    t = view.cache.get("transposed")
    if t is not None:
        keys += [("transposed", k) for k in t.cache]
    return keys


def add_self_loops(graph: Any) -> CSRGraph:
    """The graph with an edge ``d -> d`` appended to every destination row ``d`` (kept with the graph's view).

    Needs ``num_dst_nodes <= num_src_nodes`` (destinations are the first sources).
    Returns a trusted `datapath.graph.CSRGraph` (indptr int64, indices of the input dtype) on
    the graph's device; no host synchronisation.
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
        g = CSRGraph(new_ptr, new_idx, csr.num_src, csr.num_dst, trusted=True)
        if csr.max_degree is not None:  # the loop graph is valid by construction; carry what is known
            view = CSRView(new_ptr, new_idx, csr.num_src, csr.num_dst, trusted=False,
                           max_degree=csr.max_degree + 1)
            sig = (new_ptr, new_idx, new_ptr._version, new_idx._version)
            with _VIEWS_LOCK:
                _VIEWS[g] = (sig, view)
        return g
    return csr.cached("with_self_loops", make)
