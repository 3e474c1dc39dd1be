"""`HeteroGraph`: node types with counts and typed relations, each relation a `Graph` (a CSR of destination rows).

A relation ``(src_type, name, dst_type)`` is a bipartite CSR: row ``d`` (a node of ``dst_type``)
lists the ``src_type`` ids of the edges ``s -> d``.  Every relation lives in one placement
(``"cpu"``, ``"unified"``, ``"cuda"``), like `Graph`, and node ids are per type, in
``[0, num_nodes[type])`` (PyG's ``HeteroData`` convention).

    hg = HeteroGraph.from_pyg(data).to("unified")       # every relation pinned, read by GPU kernels
    hg.check_features({"paper": x_paper, "author": x_author})
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from datapath.graph._files import atomic_directory, save_json
from datapath.graph.errors import InvalidGraphError
from datapath.graph.graph import Graph, by_destination, validate_csr
from datapath.memory import PLACEMENTS

EdgeType = tuple[str, str, str]


class HeteroGraphError(InvalidGraphError):
    """A heterogeneous graph or its per-type inputs are inconsistent: an unknown node type or relation, ids
    outside a type's range, or a feature table whose rows do not match its type's node count.  The message
    names the type or relation."""


def _count(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        if isinstance(n, torch.Tensor) and n.numel() == 1:
            return _count(name, int(n))
        raise HeteroGraphError(f"node type {name!r}: the node count must be an int >= 0, got {n!r}")
    return int(n)


def _relation_graph(edge_index: Any, n_src: int, n_dst: int, et: EdgeType) -> Graph:
    """The CSR (rows: ``dst_type`` ids) of a relation given as a (2, E) ``edge_index`` of per-type ids."""
    ei = torch.as_tensor(edge_index)
    if ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype not in (torch.int32, torch.int64):
        raise HeteroGraphError(f"relation {et}: edge_index must be a (2, E) int32/int64 tensor, "
                               f"got {tuple(ei.shape)} {ei.dtype}")
    src, dst = ei[0].long(), ei[1].long()
    if ei.shape[1]:
        for ids, n, t, side in ((src, n_src, et[0], "source"), (dst, n_dst, et[2], "destination")):
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= n:
                raise HeteroGraphError(
                    f"relation {et}: {side} ids range over [{lo}, {hi}] but node type {t!r} has {n} nodes; "
                    f"ids are per type, in [0, {n})")
    return by_destination(src, dst, n_dst, n_src)


class HeteroGraph:
    """Node types with counts, and relations ``(src_type, name, dst_type)``, each a `Graph` in one placement.

    Args:
        num_nodes: ``{node_type: count}``.
        relations: ``{(src_type, name, dst_type): graph}``, each a `Graph` with
            ``num_src_nodes == num_nodes[src_type]`` and ``num_dst_nodes == num_nodes[dst_type]``
            (rows are destinations), or a (2, E) ``edge_index`` of per-type ids (PyG's convention).
        validate: check every relation's CSR (index ranges: one host read per relation).

    Attributes:
        node_types: the node types, in the order given.
        edge_types: the relations' triples, in the order given (a relation's index is its type id).
        num_nodes: ``{node_type: count}``.
        relations: ``{edge_type: Graph}``.

    Raises `HeteroGraphError` naming the type or relation: a relation naming an unknown node type,
    ids outside a type's range, counts that disagree with a relation's CSR, relations in
    different placements.
    """

    def __init__(self, num_nodes: Mapping[str, int], relations: Mapping[EdgeType, Any], *,
                 validate: bool = True) -> None:
        if not isinstance(num_nodes, Mapping) or not num_nodes:
            raise HeteroGraphError("num_nodes must be a non-empty {node_type: count} mapping")
        counts: dict[str, int] = {}
        for t, n in num_nodes.items():
            if not isinstance(t, str) or not t:
                raise HeteroGraphError(f"node types must be non-empty strings, got {t!r}")
            counts[t] = _count(t, n)
        rels: dict[EdgeType, Graph] = {}
        for et, g in relations.items():
            if not (isinstance(et, tuple) and len(et) == 3 and all(isinstance(p, str) for p in et)):
                raise HeteroGraphError(f"a relation is a (src_type, name, dst_type) triple of strings, got {et!r}")
            for t, side in ((et[0], "source"), (et[2], "destination")):
                if t not in counts:
                    raise HeteroGraphError(
                        f"relation {et}: its {side} type {t!r} is not a node type; the node types are "
                        f"{sorted(counts)} (add {t!r} to num_nodes)")
            n_src, n_dst = counts[et[0]], counts[et[2]]
            if not isinstance(g, Graph):
                g = _relation_graph(g, n_src, n_dst, et)
            if g.num_src_nodes != n_src or g.num_dst_nodes != n_dst:
                raise HeteroGraphError(
                    f"relation {et}: its CSR has {g.num_dst_nodes} rows and {g.num_src_nodes} source nodes, but "
                    f"node type {et[2]!r} has {n_dst} nodes and {et[0]!r} has {n_src}; rows are destinations")
            if validate:
                try:
                    validate_csr(g.indptr, g.indices, n_src, g.edge_ids)
                except InvalidGraphError as exc:
                    raise HeteroGraphError(f"relation {et} (source type {et[0]!r}, {n_src} nodes): {exc}") from exc
            rels[et] = g
        names = [et[1] for et in rels]
        if not rels:
            raise HeteroGraphError("a heterogeneous graph needs at least one relation")
        where = {g.placement for g in rels.values()}
        if len(where) != 1:
            raise HeteroGraphError(f"every relation must live in one memory, got {sorted(where)}; call .to(where)")
        self.num_nodes = counts
        self.relations = rels
        self._names = {n: [et for et in rels if et[1] == n] for n in names}

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_pyg(cls, data: Any, *, validate: bool = True) -> "HeteroGraph":
        """From a PyG ``HeteroData`` (its node counts and each edge type's ``edge_index``; features stay there)."""
        try:
            node_types, edge_types = data.node_types, data.edge_types
        except AttributeError as exc:
            raise HeteroGraphError(f"expected a torch_geometric HeteroData, got {type(data).__name__}") from exc
        counts = {}
        for t in node_types:
            n = data[t].num_nodes
            if n is None:
                raise HeteroGraphError(f"node type {t!r} has no num_nodes (and no x); set data[{t!r}].num_nodes")
            counts[t] = int(n)
        rels = {}
        for et in edge_types:
            ei = getattr(data[et], "edge_index", None)
            if ei is None:
                raise HeteroGraphError(f"relation {et} has no edge_index (SparseTensor adj_t is not supported)")
            rels[tuple(et)] = ei
        return cls(counts, rels, validate=validate)

    # -- queries ---------------------------------------------------------------------------
    @property
    def node_types(self) -> list[str]:
        return list(self.num_nodes)

    @property
    def edge_types(self) -> list[EdgeType]:
        return list(self.relations)

    @property
    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``(node_types, edge_types)``, PyG's ``HeteroData.metadata()``."""
        return self.node_types, self.edge_types

    @property
    def placement(self) -> str:
        return next(iter(self.relations.values())).placement

    @property
    def num_edges(self) -> dict[EdgeType, int]:
        return {et: g.num_edges for et, g in self.relations.items()}

    def edge_type(self, key: str | EdgeType) -> EdgeType:
        """The full triple of a relation given by its triple or by its name (when the name is unique)."""
        if isinstance(key, tuple):
            if key not in self.relations:
                raise HeteroGraphError(f"relation {key} is not in the graph; its relations are {self.edge_types}")
            return key
        found = self._names.get(key, [])
        if len(found) != 1:
            what = "no relation" if not found else f"{len(found)} relations ({found})"
            raise HeteroGraphError(f"{what} named {key!r}; name a relation by its (src, name, dst) triple")
        return found[0]

    def __getitem__(self, key: str | EdgeType) -> Graph:
        return self.relations[self.edge_type(key)]

    def check_node_type(self, t: str) -> str:
        if t not in self.num_nodes:
            raise HeteroGraphError(f"node type {t!r} is not in the graph; its node types are {self.node_types}")
        return t

    def check_ids(self, t: str, ids: torch.Tensor, what: str = "ids") -> None:
        """Raise unless ``ids`` (1-D int) all lie in ``[0, num_nodes[t])`` (one host read)."""
        self.check_node_type(t)
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise HeteroGraphError(f"{what} of node type {t!r} must be a 1-D int32/int64 tensor")
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= self.num_nodes[t]:
                raise HeteroGraphError(f"{what} of node type {t!r} range over [{lo}, {hi}] but the type has "
                                       f"{self.num_nodes[t]} nodes")

    def check_features(self, tables: Mapping[str, Any], what: str = "features") -> dict[str, Any]:
        """``tables`` (``{node_type: (N_t, ...) tensor or FeatureStore}``) checked against the node counts.

        Raises `HeteroGraphError` naming the node type for an unknown type or a row count that is not
        the type's node count.  Types without a table are allowed (a model gives them embeddings).
        """
        if not isinstance(tables, Mapping):
            raise HeteroGraphError(f"{what} must be a {{node_type: table}} mapping, got {type(tables).__name__}")
        for t, table in tables.items():
            if t not in self.num_nodes:
                raise HeteroGraphError(f"{what} name node type {t!r}, which is not in the graph; its node types "
                                       f"are {self.node_types}")
            shape = tuple(getattr(table, "shape", (None,)))
            if len(shape) < 2:
                raise HeteroGraphError(f"{what} of node type {t!r} must be (num_nodes, F) rows, got shape {shape}; "
                                       f"give a 1-wide feature as x.unsqueeze(1)")
            rows = shape[0]
            if rows != self.num_nodes[t]:
                raise HeteroGraphError(f"{what} of node type {t!r} have {rows} rows but the type has "
                                       f"{self.num_nodes[t]} nodes; pass one row per node of the type")
        return dict(tables)

    def edge_index_dict(self) -> dict[EdgeType, torch.Tensor]:
        """``{edge_type: (2, E) int64 edge_index}`` of per-type ids (PyG's ``edge_index_dict``), in CSR order."""
        return {et: g.edge_index() for et, g in self.relations.items()}

    # -- placement / files -----------------------------------------------------------------
    def to(self, where: str) -> "HeteroGraph":
        """This graph with every relation in ``where`` (``"cpu"``, ``"unified"``, ``"cuda"``)."""
        if where not in PLACEMENTS:
            raise HeteroGraphError(f"a graph can live in {PLACEMENTS}, not {where!r}")
        if where == self.placement:
            return self
        return HeteroGraph(self.num_nodes, {et: g.to(where) for et, g in self.relations.items()}, validate=False)

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``hetero.json`` and one `Graph` directory per relation (``rel_<i>/``) into ``directory``, all at once.

        The files are written into a temporary sibling and swapped into place (`atomic_directory`): an
        interrupted save leaves what was there before.  A non-empty ``directory`` is replaced only with
        ``overwrite=True``.
        """
        target = Path(directory)
        with atomic_directory(target, overwrite, "heterogeneous graph") as tmp:
            self.write_into(tmp)
        return target

    def write_into(self, d: Path) -> None:
        """The files of `save` into the existing directory ``d`` (a dataset writer's temporary directory)."""
        for i, g in enumerate(self.relations.values()):
            g.save(d / f"rel_{i}")
        save_json(d / "hetero.json", {"num_nodes": self.num_nodes, "edge_types": [list(et) for et in self.edge_types]})

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = True, validate: bool = True) -> "HeteroGraph":
        """Load a graph written by `save` (each relation memory-mapped by default)."""
        d = Path(directory)
        if not (d / "hetero.json").is_file():
            raise HeteroGraphError(f"{d} is not a heterogeneous graph directory: missing hetero.json")
        meta = json.loads((d / "hetero.json").read_text())
        rels = {tuple(et): Graph.load(d / f"rel_{i}", mmap=mmap, validate=False)
                for i, et in enumerate(meta["edge_types"])}
        return cls(meta["num_nodes"], rels, validate=validate)

    def __repr__(self) -> str:
        nodes = ", ".join(f"{t}={n}" for t, n in self.num_nodes.items())
        return (f"HeteroGraph(nodes: {nodes}; {len(self.relations)} relations, "
                f"{sum(self.num_edges.values())} edges, placement={self.placement!r})")
