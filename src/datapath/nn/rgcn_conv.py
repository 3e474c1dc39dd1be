"""Relational GCN (Schlichtkrull et al.) over typed graphs, with basis and block-diagonal decomposition."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from datapath.nn._hetero_inputs import EdgeType, RelationIds, check_decomposition, glorot_, hetero_inputs
from datapath.ops.typed import concat_inputs, relations_into, stacked_mean


class RGCNConv(nn.Module):
    """R-GCN: ``out_i = x_i W_root + b + sum_r mean_{j in N_r(i)} x_j W_r``.

    Args:
        in_channels: input width (every node type).
        out_channels: output width.
        edge_types: the relations ``(src, name, dst)`` (a `HeteroGraph`'s ``edge_types``); relation r's
            weight is ``weight[r]``.
        num_bases: basis decomposition ``W_r = sum_b comp[r, b] weight[b]``.
        num_blocks: block-diagonal decomposition (``weight[r]`` is ``num_blocks`` diagonal blocks).
        root_weight / bias: the self term ``x_i W_root`` (one matrix for every type) and the bias.

    PyG's parameter names and shapes (``weight``, ``comp``, ``root``, ``bias``), so a PyG ``RGCNConv``
    state dict loads as is (its relation ids are the positions in ``edge_types``).
    ``forward(graph, x)``: a `HeteroBlock` or `HeteroGraph` and ``{node_type: (num_src[t], in)}``;
    returns ``{node_type: (num_dst[t], out)}`` for the types with destinations.

    Each relation's neighbours are averaged first (`datapath.ops.aggregate` on its CSR, float32 sums),
    then the typed linear runs once per (destination, relation): one matmul over the relations
    concatenated along the input width.  No per-edge transform is materialised.
    """

    def __init__(self, in_channels: int, out_channels: int, edge_types: Sequence[EdgeType],
                 num_bases: int | None = None, num_blocks: int | None = None, root_weight: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        check_decomposition(num_bases, num_blocks)
        self.edge_types = [tuple(et) for et in edge_types]
        self.rel_id = RelationIds(self.edge_types)
        r = len(self.edge_types)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.num_bases, self.num_blocks = num_bases, num_blocks
        if num_bases is not None:
            self.weight = nn.Parameter(torch.empty(num_bases, in_channels, out_channels))
            self.comp = nn.Parameter(torch.empty(r, num_bases))
        elif num_blocks is not None:
            if in_channels % num_blocks or out_channels % num_blocks:
                raise ValueError(f"num_blocks={num_blocks} must divide in_channels={in_channels} and "
                                 f"out_channels={out_channels}")
            self.weight = nn.Parameter(torch.empty(r, num_blocks, in_channels // num_blocks,
                                                   out_channels // num_blocks))
            self.register_parameter("comp", None)
        else:
            self.weight = nn.Parameter(torch.empty(r, in_channels, out_channels))
            self.register_parameter("comp", None)
        self.root = nn.Parameter(torch.empty(in_channels, out_channels)) if root_weight else None
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.weight)
        if self.comp is not None:
            glorot_(self.comp)
        if self.root is not None:
            glorot_(self.root)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def relation_weights(self) -> torch.Tensor:
        """(R, in, out) dense weights (basis-combined); not for the block-diagonal form."""
        if self.num_bases is not None:
            return (self.comp @ self.weight.view(self.num_bases, -1)).view(-1, self.in_channels, self.out_channels)
        return self.weight

    def forward(self, graph: Any, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, num_dst = hetero_inputs(graph, x, self.edge_types, self.in_channels)
        dense = None if self.num_blocks is not None else self.relation_weights()
        x_all = None
        out: dict[str, torch.Tensor] = {}
        for t, n in num_dst.items():
            if n == 0 or t not in x:
                continue
            x_dst = x[t][:n]
            into = relations_into(graph, t)
            if self.root is not None:
                h = torch.addmm(self.bias, x_dst, self.root) if self.bias is not None else x_dst @ self.root
            else:
                h = self.bias.expand(n, -1) if self.bias is not None else x_dst.new_zeros(n, self.out_channels)
            if into.edge_types:
                if x_all is None:
                    x_all = concat_inputs(graph, x)
                z = stacked_mean(into, x_all)                            # (n, R_t * in): every (node, relation)
                ids = self.rel_id.tensor(into.edge_types, z.device)
                if dense is not None:  # one matmul over the relations stacked along the input width
                    agg = z @ dense.index_select(0, ids).reshape(-1, self.out_channels)
                else:
                    nb = self.num_blocks
                    z = z.view(n, len(ids), nb, -1)                       # (n, R_t, B, in/B)
                    agg = torch.einsum("nrbi,rbio->nbo", z, self.weight.index_select(0, ids))
                    agg = agg.reshape(n, self.out_channels)
                h = h + agg
            out[t] = h
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, num_relations={len(self.edge_types)}"
