"""Full-graph GNN models (the seed papers' experiment): `GCN` and `GIN` over one whole graph.

``model(graph, x)``: ``graph`` a CSR of destination rows over all nodes (`datapath.graph.Graph`
or any `datapath.graph.CSR`), ``x`` (num_nodes, F) node features; returns (num_nodes,
out_channels) logits.  GNNAdvisor and TC-GNN evaluate GCN (2 layers, hidden 16) and GIN
(5 layers, hidden 64) this way; `build_full_graph_model` builds those.

``backend="datapath"`` builds on `datapath.nn`; ``backend="pyg"`` on ``torch_geometric.nn``
with the same parameter names (``load_state_dict`` carries weights across), fed the graph's
``edge_index`` (computed once per graph), so both compute the same function.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn.models import _pyg_nn  # the one lazy import of torch_geometric

FULL_GRAPH_MODELS = ("gcn", "gin")


class _FullGraphModel(nn.Module):
    def __init__(self, backend: str, dropout: float) -> None:
        super().__init__()
        if backend not in ("datapath", "pyg"):
            raise ValueError(f"backend must be 'datapath' or 'pyg', got {backend!r}")
        self.backend = backend
        self.dropout = dropout
        self.convs = nn.ModuleList()
        self._edge_index: "weakref.WeakKeyDictionary[Any, torch.Tensor]" = weakref.WeakKeyDictionary()

    def edge_index(self, graph: Any) -> torch.Tensor:
        """(2, E) int64 PyG ``edge_index`` of ``graph`` (row 0 source, row 1 destination), made once per graph."""
        ei = self._edge_index.get(graph)
        if ei is None:
            ptr = graph.indptr
            dst = torch.repeat_interleave(torch.arange(graph.num_dst_nodes, device=ptr.device),
                                          (ptr[1:] - ptr[:-1]).long(), output_size=graph.indices.numel())
            ei = self._edge_index[graph] = torch.stack([graph.indices.long(), dst])
        return ei

    def _layer(self, i: int, graph: Any, h: torch.Tensor) -> torch.Tensor:
        if self.backend == "pyg":
            if i == 0:
                self._pyg_graph_changes(graph)
            return self.convs[i](h, self.edge_index(graph))
        return self.convs[i](graph, h)

    def _pyg_graph_changes(self, graph: Any) -> None:
        """PyG's ``cached=True`` layers keep the first graph's normalised adjacency, unkeyed: on another graph
        (or the same one modified in place) they are told to recompute it."""
        ptr = getattr(graph, "indptr", None)
        key = (ptr._version, graph.indices._version) if ptr is not None else None
        seen = self.__dict__.get("_pyg_graph")
        if seen is not None and seen[0]() is graph and seen[1] == key:
            return
        for conv in self.convs:
            for attr in ("_cached_edge_index", "_cached_adj_t"):
                if hasattr(conv, attr):
                    setattr(conv, attr, None)
        try:
            self.__dict__["_pyg_graph"] = (weakref.ref(graph), key)
        except TypeError:  # not weakly referenceable: recomputed every call
            self.__dict__.pop("_pyg_graph", None)

    def forward(self, graph: Any, x: torch.Tensor) -> torch.Tensor:
        """(num_nodes, F) features -> (num_nodes, out_channels) logits."""
        if x.shape[0] != graph.num_src_nodes:
            raise ValueError(f"x has {x.shape[0]} rows but the graph has {graph.num_src_nodes} nodes")
        h = x
        for i in range(len(self.convs)):
            h = self._layer(i, graph, h)
            if i < len(self.convs) - 1:
                h = F.dropout(F.relu(h), p=self.dropout, training=self.training)
        return h

    def prepare(self, graph: Any, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Build every layer's aggregation data for ``graph`` ahead of the first step (datapath backend)."""
        if self.backend != "datapath":
            self.edge_index(graph)
            return []
        out: list[torch.Tensor] = []
        for i, conv in enumerate(self.convs):
            out += conv.prepare(graph, dtype, input_grad=i > 0)
        return out


class GCN(_FullGraphModel):
    """GCN (Kipf & Welling): ``num_layers`` GCNConv layers with self loops and symmetric normalization,
    ReLU and dropout between them (PyG's ``GCNConv(cached=True)`` on the pyg backend)."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5, backend: str = "datapath") -> None:
        super().__init__(backend, dropout)
        dims = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        for a, b in zip(dims[:-1], dims[1:]):
            if backend == "pyg":
                self.convs.append(_pyg_nn().GCNConv(a, b, cached=True))
            else:
                from datapath.nn.gcn_conv import GCNConv  # noqa: PLC0415

                self.convs.append(GCNConv(a, b, add_self_loops=True))


class GIN(_FullGraphModel):
    """GIN (Xu et al.): ``num_layers`` GINConv layers (sum aggregation, ``eps = 0``) whose update is one
    Linear layer, as in GNNAdvisor's GIN; ReLU and dropout between layers."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 5,
                 dropout: float = 0.5, backend: str = "datapath") -> None:
        super().__init__(backend, dropout)
        dims = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        for a, b in zip(dims[:-1], dims[1:]):
            if backend == "pyg":
                self.convs.append(_pyg_nn().GINConv(nn.Linear(a, b)))
            else:
                from datapath.nn.gin_conv import GINConv  # noqa: PLC0415

                self.convs.append(GINConv(nn.Linear(a, b)))


def build_full_graph_model(name: str, in_channels: int, out_channels: int, hidden_channels: int | None = None,
                           num_layers: int | None = None, dropout: float = 0.5,
                           backend: str = "datapath") -> nn.Module:
    """``"gcn"`` (default 2 layers, hidden 16) or ``"gin"`` (default 5 layers, hidden 64), the seeds' settings."""
    if name == "gcn":
        return GCN(in_channels, hidden_channels or 16, out_channels, num_layers or 2, dropout, backend)
    if name == "gin":
        return GIN(in_channels, hidden_channels or 64, out_channels, num_layers or 5, dropout, backend)
    raise ValueError(f"model must be one of {FULL_GRAPH_MODELS}, got {name!r}")
