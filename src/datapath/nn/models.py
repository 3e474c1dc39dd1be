"""Mini-batch GNN models over sampled blocks: `GraphSAGE` and `GAT`.

``model(blocks, x)``: ``blocks`` one per layer, input layer first (as
`datapath.loaders.NeighborSampler` returns them), ``x`` (blocks[0].num_src_nodes, F)
input features; returns (blocks[-1].num_dst_nodes, out_channels) logits.  Each layer
maps the features of a block's sources to its destinations, which are the first
``num_dst_nodes`` sources of that block (DGL's convention).

``backend="datapath"`` builds on `datapath.nn` (the ops' aggregation kernels);
``backend="pyg"`` on ``torch_geometric.nn`` with the blocks turned into
``edge_index`` form, to check that both agree and that PyG layers train on our batches.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _pyg_nn() -> Any:
    from datapath._runtime.optional import require  # noqa: PLC0415

    return require("torch_geometric.nn", extra="pyg", purpose="backend='pyg'")


class _BlockModel(nn.Module):
    def __init__(self, backend: str) -> None:
        super().__init__()
        if backend not in ("datapath", "pyg"):
            raise ValueError(f"backend must be 'datapath' or 'pyg', got {backend!r}")
        self.backend = backend
        self.convs = nn.ModuleList()
        self.dropout = 0.0

    def _conv(self, i: int, block: Any, h: torch.Tensor) -> torch.Tensor:
        conv = self.convs[i]
        n_dst = block.num_dst_nodes
        if self.backend == "pyg":
            edge_index, size = block.to_pyg()
            return conv((h, h[:n_dst]), edge_index, size=size)
        return conv(block, h)

    def forward(self, blocks: Sequence[Any], x: torch.Tensor) -> torch.Tensor:
        """(num_src of blocks[0], F) input features -> (num_dst of blocks[-1], out_channels) logits."""
        self._check(blocks, x)
        h = x
        for i, block in enumerate(blocks):
            h = self._conv(i, block, h)
            if i < len(blocks) - 1:
                h = F.dropout(self._activation(h), p=self.dropout, training=self.training)
        return h

    def prepare(self, blocks: Sequence[Any], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Precompute the layers' aggregation schedules for ``blocks`` (input layer first).

        The schedules cost a few dozen small GPU ops per batch; built ahead (on the loader's
        stream, see `prepare_batch`), the training step launches only its own kernels.  Returns the tensors
        cached on the blocks; empty for layers with nothing to prepare and for ``backend="pyg"``.
        """
        if self.backend != "datapath":
            return []
        out: list[torch.Tensor] = []
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            prep = getattr(conv, "prepare", None)
            if prep is not None:
                out += prep(block, dtype, input_grad=i > 0)
        return out

    def prepare_batch(self, batch: Any) -> list[torch.Tensor]:
        """`prepare` for a `datapath.loaders.Batch`: pass as ``NeighborLoader(..., prepare=model.prepare_batch)``."""
        return self.prepare(batch.blocks, batch.x.dtype if batch.x is not None else torch.float32)

    def _check(self, blocks: Sequence[Any], x: torch.Tensor) -> None:
        if len(blocks) != len(self.convs):
            raise ValueError(f"the model has {len(self.convs)} layers but got {len(blocks)} blocks")
        if x.shape[0] != blocks[0].num_src_nodes:
            raise ValueError(f"x has {x.shape[0]} rows but blocks[0] has {blocks[0].num_src_nodes} source nodes")


class GraphSAGE(_BlockModel):
    """GraphSAGE with mean aggregation: ``num_layers`` SAGEConv layers, ReLU and dropout between them.

    Args:
        in_channels: input feature width F.
        hidden_channels: hidden width.
        out_channels: number of classes.
        num_layers: layers (= blocks per batch).
        dropout: dropout probability on hidden features.
        backend: ``"datapath"`` (`datapath.nn.SAGEConv`) or ``"pyg"``.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 3,
                 dropout: float = 0.5, backend: str = "datapath") -> None:
        super().__init__(backend)
        if backend == "pyg":
            conv_cls = _pyg_nn().SAGEConv
        else:
            from datapath.nn.sage_conv import SAGEConv as conv_cls  # noqa: PLC0415
        dims = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        for a, b in zip(dims[:-1], dims[1:]):
            self.convs.append(conv_cls(a, b))
        self.dropout = dropout

    _activation = staticmethod(F.relu)


class GAT(_BlockModel):
    """GAT: ``num_layers`` GATConv layers (``heads`` heads of ``hidden_channels // heads``, concatenated),
    ELU and dropout between them, one head on the output layer.

    Every destination also attends to itself (a self loop per destination row, as PyG's
    GATConv adds by default), so a node's own features always enter its output.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 3,
                 heads: int = 4, dropout: float = 0.5, backend: str = "datapath") -> None:
        super().__init__(backend)
        if hidden_channels % heads:
            raise ValueError(f"hidden_channels={hidden_channels} must be a multiple of heads={heads}")
        if backend == "pyg":
            conv_cls = _pyg_nn().GATConv
        else:
            from datapath.nn.gat_conv import GATConv as conv_cls  # noqa: PLC0415
        width = in_channels
        for _ in range(num_layers - 1):
            self.convs.append(conv_cls(width, hidden_channels // heads, heads=heads))
            width = hidden_channels
        self.convs.append(conv_cls(width, out_channels, heads=1))
        self.dropout = dropout

    def _conv(self, i: int, block: Any, h: torch.Tensor) -> torch.Tensor:
        if self.backend == "pyg":  # PyG's GATConv adds the self loops itself
            edge_index, size = block.to_pyg()
            return self.convs[i]((h, h[: block.num_dst_nodes]), edge_index, size=size)
        from datapath.ops import add_self_loops  # noqa: PLC0415

        return self.convs[i](add_self_loops(block), h)

    _activation = staticmethod(F.elu)


def build_model(name: str, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int,
                dropout: float = 0.5, heads: int = 4, backend: str = "datapath") -> nn.Module:
    """``"sage"`` (GraphSAGE) or ``"gat"`` (GAT) with the given widths."""
    if name == "sage":
        return GraphSAGE(in_channels, hidden_channels, out_channels, num_layers, dropout, backend)
    if name == "gat":
        return GAT(in_channels, hidden_channels, out_channels, num_layers, heads, dropout, backend)
    raise ValueError(f"model must be 'sage' or 'gat', got {name!r}")
