"""Relational models over sampled `HeteroBlock`s: R-GAT (MLPerf's GNN model), R-GCN and HGT."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn.hgt_conv import HGTConv
from datapath.nn.rgat_conv import RGATConv
from datapath.nn.rgcn_conv import RGCNConv
from datapath.ops import FeatureShapeError
from datapath.ops.typed import relations_into

HETERO_MODELS = ("rgat", "rgcn", "hgt")


class HeteroGNN(nn.Module):
    """Per-type input projection (a linear for types with features, an embedding for the others), ``num_layers``
    relational layers with ReLU and dropout between them, and a linear classifier on the target type.

    Args:
        kind: ``"rgat"``, ``"rgcn"`` or ``"hgt"``.
        metadata: ``(node_types, edge_types)`` of the `HeteroGraph`.
        in_channels: ``{node_type: feature width}`` of the types with features.
        num_nodes: ``{node_type: count}`` (embeddings for the featureless types).
        hidden_channels / out_channels / num_layers / heads / dropout: the usual.
        target: the node type classified.

    ``forward(blocks, x)``: ``blocks`` input layer first, ``x`` ``{type: (num_src[t], F_t)}`` of
    ``blocks[0]``; returns (num_dst[target] of ``blocks[-1]``, out_channels) logits.
    """

    def __init__(self, kind: str, metadata: tuple[Sequence[str], Sequence[tuple[str, str, str]]],
                 in_channels: Mapping[str, int], num_nodes: Mapping[str, int], hidden_channels: int,
                 out_channels: int, num_layers: int = 2, heads: int = 4, dropout: float = 0.2,
                 target: str = "paper") -> None:
        super().__init__()
        if kind not in HETERO_MODELS:
            raise ValueError(f"kind must be one of {HETERO_MODELS}, got {kind!r}")
        if hidden_channels % heads:
            raise ValueError(f"hidden_channels ({hidden_channels}) must be divisible by heads ({heads})")
        node_types, edge_types = list(metadata[0]), [tuple(et) for et in metadata[1]]
        self.kind, self.target, self.dropout = kind, target, dropout
        self.proj = nn.ModuleDict({t: nn.Linear(c, hidden_channels) for t, c in in_channels.items()})
        self.emb = nn.ModuleDict({t: nn.Embedding(num_nodes[t], hidden_channels)
                                  for t in node_types if t not in in_channels})
        convs: list[nn.Module] = []
        for _ in range(num_layers):
            if kind == "rgat":
                convs.append(RGATConv(hidden_channels, hidden_channels // heads, edge_types, heads=heads))
            elif kind == "rgcn":
                convs.append(RGCNConv(hidden_channels, hidden_channels, edge_types))
            else:
                convs.append(HGTConv(hidden_channels, hidden_channels, (node_types, edge_types), heads=heads))
        self.convs = nn.ModuleList(convs)
        self.head = nn.Linear(hidden_channels, out_channels)

    def forward(self, blocks: Sequence[Any], x: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if len(blocks) != len(self.convs):
            raise ValueError(f"the model has {len(self.convs)} layers but got {len(blocks)} blocks")
        for t, v in x.items():
            if t not in self.proj:
                raise FeatureShapeError(
                    f"x names node type {t!r}, for which the model takes no features (it takes {sorted(self.proj)}); "
                    f"build it with in_channels[{t!r}] or leave {t!r} out of x")
            width = self.proj[t].in_features
            if v.dim() != 2 or v.shape[1] != width:
                raise FeatureShapeError(f"x[{t!r}] has shape {tuple(v.shape)} but the model takes {width} features "
                                        f"per node of type {t!r}; pass (num_src_nodes[{t!r}], {width}) rows")
        h = {t: self.proj[t](v) for t, v in x.items() if t in self.proj}
        for t, emb in self.emb.items():
            ids = blocks[0].src_nodes[t]
            h[t] = emb(ids)
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            h = conv(block, h)
            if i < len(self.convs) - 1:
                h = {t: F.dropout(F.relu(v), self.dropout, self.training) for t, v in h.items()}
        return self.head(h[self.target])

    def prepare(self, blocks: Sequence[Any]) -> list[torch.Tensor]:
        """Build the merged relations of every layer now (e.g. in a loader's thread); their tensors."""
        out: list[torch.Tensor] = []
        for block in blocks:
            for t in block.dst_types:
                out += relations_into(block, t).tensors()
        return out

    def prepare_batch(self, batch: Any) -> list[torch.Tensor]:
        return self.prepare(batch.blocks)
