"""Typed ops for relational layers: relations merged per destination type, compact source sets, typed linears.

Hector's compact materialisation: a relational layer transforms each (node, relation) pair once --
the distinct sources of a relation, gathered and multiplied by the relation's weight -- never each
edge, then aggregates over the relations *merged* into one CSR per destination type, whose columns
index the concatenation of the relations' compact tables.  One `datapath.ops.aggregate` /
`edge_softmax` / `sddmm` launch then covers every relation into a type (a softmax across relations
needs exactly that), accumulating in float32 for half-precision rows.

    into = relations_into(block, "paper")               # kept with the block: built once
    h = typed_linear([x[s][src] for s, src in zip(into.src_types, into.sources)], into.weights(w))
    out = aggregate(into.csr, h, "sum", edge_weight=alpha)

Graphs are `datapath.sampling.HeteroBlock`s (sampled layers) or `datapath.graph.HeteroGraph`s (whole
graphs: a node's sources are all nodes of the type).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from datapath.graph.csr import CSRGraph
from datapath.ops._graph import as_csr
from datapath.ops.errors import FeatureShapeError, GraphFormatError, GraphIndexError

EdgeType = tuple[str, str, str]


@dataclass(eq=False)
class TypedRelations:
    """The relations into one destination type, merged into one CSR over their compact source tables.

    Attributes:
        dst_type: the destination node type.
        edge_types: the relations ``(src, name, dst_type)``, in the graph's order; ``rel`` ids index this list.
        sources: per relation, (U_r,) int64 rows of the source type's inputs that the relation reads
            (distinct and sorted with ``compact``; all rows otherwise).
        offsets: (R+1,) host ints; relation r's rows of the concatenated table are ``offsets[r]:offsets[r+1]``.
        csr: a trusted CSR of the destination rows over the concatenated table (``num_src = offsets[-1]``);
            each row lists its edges relation by relation.
        edge_rel: (E,) int64 relation id of each merged edge.
        edge_dst: (E,) int64 destination row of each merged edge.
        num_dst: destination rows.
        table_rows: (offsets[-1],) int64 rows of `concat_inputs` that the concatenated table transforms
            (relation r's ``sources`` shifted by its source type's offset): one gather for every relation.
        stacked: a trusted CSR of ``num_dst * R`` rows, row ``d * R + r`` listing relation r's sources of d as
            rows of `concat_inputs`: one aggregation gives every (destination, relation) pair's row.
        type_offsets: ``{node_type: first row}`` of each type's inputs in `concat_inputs`.
    """

    dst_type: str
    edge_types: list[EdgeType]
    sources: list[torch.Tensor]
    offsets: list[int]
    csr: CSRGraph
    edge_rel: torch.Tensor
    edge_dst: torch.Tensor
    num_dst: int
    table_rows: torch.Tensor
    stacked: CSRGraph
    type_offsets: dict[str, int]

    @property
    def src_types(self) -> list[str]:
        return [et[0] for et in self.edge_types]

    @cached_property
    def query_rows(self) -> torch.Tensor:
        """(E,) int64 ``edge_dst * R + edge_rel``: each merged edge's row in a (num_dst * R, ...) table of per
        (destination, relation) values, e.g. R-GAT's queries ``x_i W_r q``."""
        return self.edge_dst * len(self.edge_types) + self.edge_rel

    def tensors(self) -> list[torch.Tensor]:
        return [*self.sources, self.csr.indptr, self.csr.indices, self.edge_rel, self.edge_dst, self.table_rows,
                self.stacked.indptr, self.stacked.indices]


def _relations(graph: Any) -> tuple[dict[EdgeType, Any], dict[str, int], dict[str, int]]:
    """(relations, num_src per type, num_dst per type) of a HeteroBlock or a HeteroGraph."""
    rels = getattr(graph, "relations", None)
    if rels is None:
        raise GraphFormatError(f"expected a HeteroBlock or HeteroGraph, got {type(graph).__name__}")
    if hasattr(graph, "src_nodes"):
        return rels, graph.num_src_nodes, graph.num_dst_nodes
    return rels, dict(graph.num_nodes), dict(graph.num_nodes)


def relations_into(graph: Any, dst_type: str, compact: bool = True) -> TypedRelations:
    """The relations of ``graph`` into ``dst_type``, merged (see `TypedRelations`); kept with the graph.

    ``compact``: each relation's table holds only the sources it reads (one ``torch.unique`` per
    relation, a host synchronisation on the GPU; built once per block, e.g. in a loader's ``prepare``).
    """
    key = ("typed_relations", dst_type, bool(compact))
    keep = getattr(graph, "derived", None)
    make = lambda: _merge(graph, dst_type, compact)  # noqa: E731
    return keep(key, make) if keep is not None else make()


def _merge(graph: Any, dst_type: str, compact: bool) -> TypedRelations:
    rels, num_src, num_dst = _relations(graph)
    if dst_type not in num_dst:
        raise GraphFormatError(f"node type {dst_type!r} is not in the graph; its types are {sorted(num_dst)}")
    ets = [et for et in rels if et[2] == dst_type]
    n = int(num_dst[dst_type])
    dev = next(iter(rels.values())).indices.device if rels else getattr(graph, "device", torch.device("cpu"))
    sources, degs, ptrs, idxs = [], [], [], []
    offsets = [0]
    for et in ets:
        r = rels[et]
        if getattr(r, "trusted", True) is False:  # a relation its maker did not vouch for: checked once here,
            try:  # as the ops check an untrusted graph (the merged CSRs below are trusted by the kernels)
                as_csr(r)
            except (GraphFormatError, GraphIndexError) as exc:
                raise type(exc)(f"relation {et} (source type {et[0]!r}, {num_src[et[0]]} nodes): {exc}") from exc
        ptr = r.indptr.to(torch.int64)
        idx = r.indices.to(torch.int64)
        if compact:
            src, inv = torch.unique(idx, sorted=True, return_inverse=True)
        else:
            src, inv = torch.arange(num_src[et[0]], device=dev), idx
        sources.append(src)
        offsets.append(offsets[-1] + src.numel())
        degs.append(ptr[1:] - ptr[:-1])
        ptrs.append(ptr)
        idxs.append(inv)
    deg_all = torch.stack(degs).sum(0) if degs else torch.zeros(n, dtype=torch.int64, device=dev)
    indptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(deg_all, 0, out=indptr[1:])
    type_offsets, acc = {}, 0
    for t, cnt in num_src.items():
        type_offsets[t] = acc
        acc += int(cnt)
    table_rows = (torch.cat([src + type_offsets[et[0]] for et, src in zip(ets, sources)]) if ets
                  else torch.zeros(0, dtype=torch.int64, device=dev))
    # the stacked CSR: row d*R + r holds relation r's sources of d (rows of concat_inputs)
    nr = len(ets)
    counts = torch.stack(degs, 1).reshape(-1) if ets else torch.zeros(0, dtype=torch.int64, device=dev)
    s_ptr = torch.zeros(n * nr + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=s_ptr[1:])
    e_all = sum(int(i.numel()) for i in idxs)
    indices = torch.empty(e_all, dtype=torch.int64, device=dev)
    edge_rel = torch.empty(e_all, dtype=torch.int64, device=dev)
    edge_dst = torch.empty(e_all, dtype=torch.int64, device=dev)
    s_idx = torch.empty(e_all, dtype=torch.int64, device=dev)
    before = indptr[:-1].clone()  # where relation r's edges of each row start in the merged row
    for r, (et, ptr, inv, deg) in enumerate(zip(ets, ptrs, idxs, degs)):
        e = inv.numel()
        row = torch.repeat_interleave(torch.arange(n, device=dev), deg, output_size=e)
        within = torch.arange(e, device=dev) - ptr[row]  # each edge's place in its row of relation r
        pos = before[row] + within
        indices[pos] = inv + offsets[r]
        edge_rel[pos] = r
        edge_dst[pos] = row
        before += deg
        s_idx[s_ptr[row * nr + r] + within] = rels[et].indices.to(torch.int64) + type_offsets[et[0]]
    hints = [getattr(rels[et], "max_degree", None) for et in ets]
    known = bool(ets) and all(isinstance(h, int) for h in hints)
    csr = CSRGraph(indptr, indices, offsets[-1], n, trusted=True)
    csr.max_degree = sum(hints) if known else None  # type: ignore[attr-defined] - read by datapath.ops
    stacked = CSRGraph(s_ptr, s_idx, acc, n * nr, trusted=True)
    stacked.max_degree = max(hints) if known else None  # type: ignore[attr-defined]
    return TypedRelations(dst_type, ets, sources, offsets, csr, edge_rel, edge_dst, n, table_rows, stacked,
                          type_offsets)


def concat_inputs(graph: Any, x: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every node type's input rows of ``graph``, concatenated in the graph's type order ((sum N_t, F), one copy).

    The merged relations' ``table_rows`` and ``stacked`` index it; a type with rows but no entry in ``x`` is
    an error naming it (all types need one width).
    """
    _, num_src, _ = _relations(graph)
    parts = []
    for t, cnt in num_src.items():
        if t not in x:
            if cnt:
                raise FeatureShapeError(f"no input rows for node type {t!r} ({cnt} in the graph)")
            continue
        parts.append(x[t])
    widths = {p.shape[1] for p in parts}
    if len(widths) > 1:
        raise FeatureShapeError(f"the node types' inputs have different widths {sorted(widths)}; project them "
                                f"to one width first")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def typed_linear(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The concatenation of ``xs[i] @ weights[i] (+ biases[i])``: a segment matmul over rows grouped by type.

    Args:
        xs: per type (N_i, K) rows (one dtype and device).
        weights: per type (K, M).
        biases: optional per type (M,) or None.

    Returns:
        (sum N_i, M) in the inputs' dtype (cuBLAS accumulates half precision in float32); differentiable.
    """
    if len(xs) != len(weights) or (biases is not None and len(biases) != len(xs)):
        raise FeatureShapeError(f"typed_linear needs one weight (and bias) per type, got {len(xs)} inputs, "
                                f"{len(weights)} weights")
    if not xs:
        raise FeatureShapeError("typed_linear needs at least one type")
    outs = []
    for i, (x, w) in enumerate(zip(xs, weights)):
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
            raise FeatureShapeError(f"type {i}: rows {tuple(x.shape)} cannot multiply weight {tuple(w.shape)}")
        b = biases[i] if biases is not None else None
        outs.append(torch.addmm(b, x, w) if b is not None else x @ w)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def compact_linear(into: TypedRelations, x_all: torch.Tensor | Mapping[str, torch.Tensor], weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Transform each (source node, relation) pair of ``into`` once: ``cat_r(x[src_r][sources_r] @ weights[r])``.

    Args:
        into: `relations_into` of the layer's graph and destination type.
        x_all: (sum N_t, K) `concat_inputs` of the layer's inputs, or the ``{node_type: (N_t, K_t)}`` inputs
            themselves (types of different widths, each relation's weight fitting its source type).
        weights: per relation of ``into`` (K, M); biases optional per relation (M,).

    Returns:
        (into.offsets[-1], M): the concatenated table the merged CSR's columns index (one gather, then a
        segment matmul over the relations' row ranges).
    """
    if isinstance(x_all, Mapping):  # per-type inputs (of different widths): one gather per relation
        parts = [x_all[et[0]].index_select(0, src) for et, src in zip(into.edge_types, into.sources)]
        return typed_linear(parts, weights, biases)
    rows = x_all.index_select(0, into.table_rows)
    o = into.offsets
    parts = rows.split([o[i + 1] - o[i] for i in range(len(into.edge_types))]) if len(o) > 2 else [rows]
    return typed_linear(parts, weights, biases)


def stacked_mean(into: TypedRelations, x_all: torch.Tensor) -> torch.Tensor:
    """(num_dst, R * K): for every destination the mean of each relation's sources, relations side by side (0 for
    none) -- one `datapath.ops.aggregate` over ``into.stacked`` (float32 sums), ready for one matmul with the
    relations' weights stacked along K: R-GCN's aggregate-then-transform order, one row per (node, relation)."""
    from datapath.ops.aggregate import aggregate  # noqa: PLC0415

    return aggregate(into.stacked, x_all, "mean").view(into.num_dst, -1)
