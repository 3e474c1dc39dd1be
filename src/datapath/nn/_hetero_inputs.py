"""How a relational layer reads its inputs (a typed graph and ``{node_type: (num_src[t], F)}`` rows), and what the
relational layers share: relation ids, weight initialisation, the decomposition arguments."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from datapath.ops import FeatureShapeError, GraphFormatError

EdgeType = tuple[str, str, str]


def hetero_inputs(graph: Any, x: Mapping[str, torch.Tensor], edge_types: Sequence[EdgeType],
                  in_channels: int | Mapping[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(num_src, num_dst) per node type of ``graph`` (a `HeteroBlock` or `HeteroGraph`), after checking ``x``.

    Raises `FeatureShapeError` naming the node type whose rows do not match the graph or whose width is not the
    layer's ``in_channels`` (one for every type, or per type), and `GraphFormatError` naming a relation the layer
    was not built for.
    """
    rels = getattr(graph, "relations", None)
    if rels is None or not isinstance(x, Mapping):
        raise GraphFormatError("a relational layer takes (graph, x_dict): a HeteroBlock or HeteroGraph and "
                               "{node_type: features}")
    if hasattr(graph, "src_nodes"):
        num_src, num_dst = graph.num_src_nodes, graph.num_dst_nodes
    else:
        num_src = num_dst = dict(graph.num_nodes)
    known = set(edge_types)
    for et in rels:
        if et not in known:
            raise GraphFormatError(f"relation {et} is not one of the layer's edge types {list(edge_types)}; "
                                   f"build the layer with the graph's metadata")
    for t, v in x.items():
        if t not in num_src:
            raise FeatureShapeError(f"x names node type {t!r}, which is not in the graph ({sorted(num_src)})")
        if v.dim() != 2 or v.shape[0] != num_src[t]:
            raise FeatureShapeError(f"x[{t!r}] has shape {tuple(v.shape)} but node type {t!r} has {num_src[t]} "
                                    f"source rows in this layer; pass (num_src_nodes[{t!r}], F)")
        want = in_channels.get(t) if isinstance(in_channels, Mapping) else in_channels
        if want is not None and v.shape[1] != want:
            raise FeatureShapeError(f"x[{t!r}] has {v.shape[1]} features but the layer takes {want} for node type "
                                    f"{t!r}; project node type {t!r} to {want} features first")
    for et in rels:
        if et[0] not in x and rels[et].num_edges:
            raise FeatureShapeError(f"relation {et} reads node type {et[0]!r}, which has no rows in x")
    return num_src, num_dst


class RelationIds:
    """Each relation's id (its position in a layer's ``edge_types``): ``ids[et]``, and ``ids.tensor(ets, device)``
    the ids of ``ets`` as an int64 tensor on ``device``, made once per (relations, device): no copy per step."""

    def __init__(self, edge_types: Sequence[EdgeType]) -> None:
        self.index = {tuple(et): i for i, et in enumerate(edge_types)}
        self._tensors: dict[Any, torch.Tensor] = {}

    def __getitem__(self, et: EdgeType) -> int:
        return self.index[et]

    def __len__(self) -> int:
        return len(self.index)

    def tensor(self, ets: Sequence[EdgeType], device: torch.device) -> torch.Tensor:
        key = (tuple(ets), device)
        ids = self._tensors.get(key)
        if ids is None:
            ids = self._tensors[key] = torch.tensor([self.index[et] for et in ets], device=device)
        return ids


def glorot_(t: torch.Tensor) -> None:
    """Glorot-uniform initialisation in place over the last two dimensions (fan in + fan out)."""
    bound = (6.0 / (t.shape[-2] + t.shape[-1])) ** 0.5
    nn.init.uniform_(t, -bound, bound)


def check_decomposition(num_bases: int | None, num_blocks: int | None) -> None:
    """Raise ``ValueError`` when both decompositions are asked for."""
    if num_bases is not None and num_blocks is not None:
        raise ValueError("use either num_bases (basis decomposition) or num_blocks (block-diagonal), not both")
