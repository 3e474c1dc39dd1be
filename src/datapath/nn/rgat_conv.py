"""Relational graph attention (Busbridge et al.; PyG's ``RGATConv``) over typed graphs, compactly materialised."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._hetero_inputs import EdgeType, RelationIds, check_decomposition, glorot_, hetero_inputs
from datapath.ops import aggregate, edge_softmax
from datapath.ops.typed import compact_linear, concat_inputs, relations_into


class RGATConv(nn.Module):
    """R-GAT, additive self-attention across relations (PyG's ``RGATConv`` defaults):

    ``h_j^r = x_j W_r``, ``alpha_ij = softmax_{(j, r) -> i}(LeakyReLU(x_i W_r q + h_j^r k))`` over every
    incoming edge of ``i`` of every relation, ``out_i = concat_h sum alpha_ij^h h_j^{r,h} + b``.

    Args:
        in_channels: input width (every node type).
        out_channels: width per head.
        edge_types: the relations (relation r's weight is ``weight[r]``).
        heads: attention heads H.
        num_bases / num_blocks: basis (``basis``, ``att``) or block-diagonal decomposition of ``W_r``.
        concat: concatenate the heads (H*out) or average them (out).
        negative_slope: LeakyReLU slope.
        dropout: dropout on the attention coefficients (training only).
        bias: learnable bias.

    PyG's parameter names (``weight`` or ``basis``/``att``, ``q``, ``k``, ``bias``): a PyG ``RGATConv`` state
    dict loads with ``strict=False`` (PyG's unused ``w``, ``l1``, ``b1``, ``l2``, ``b2`` are not kept).
    Other attention modes of PyG (``within-relation``, multiplicative, ``mod``, edge features) are not
    implemented.  ``forward(graph, x)`` as for `RGCNConv`.

    Compact materialisation: ``x_j W_r`` is computed once per distinct (source, relation), the query
    side folds ``W_r q`` into an (in, H) matrix, and one `edge_softmax` / `aggregate` over the relations
    merged per destination type (`datapath.ops.typed.relations_into`) finishes the layer; per edge only
    H scores are materialised.
    """

    def __init__(self, in_channels: int, out_channels: int, edge_types: Sequence[EdgeType], heads: int = 1,
                 num_bases: int | None = None, num_blocks: int | None = None, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        check_decomposition(num_bases, num_blocks)
        self.edge_types = [tuple(et) for et in edge_types]
        self.rel_id = RelationIds(self.edge_types)
        r = len(self.edge_types)
        hc = heads * out_channels
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.num_bases, self.num_blocks = num_bases, num_blocks
        self.concat, self.negative_slope, self.dropout = concat, negative_slope, dropout
        self.q = nn.Parameter(torch.empty(hc, heads))
        self.k = nn.Parameter(torch.empty(hc, heads))
        self.bias = nn.Parameter(torch.empty(hc if concat else out_channels)) if bias else None
        if num_bases is not None:
            self.att = nn.Parameter(torch.empty(r, num_bases))
            self.basis = nn.Parameter(torch.empty(num_bases, in_channels, hc))
            self.register_parameter("weight", None)
        elif num_blocks is not None:
            if in_channels % num_blocks or hc % num_blocks:
                raise ValueError(f"num_blocks={num_blocks} must divide in_channels={in_channels} and "
                                 f"heads*out_channels={hc}")
            self.weight = nn.Parameter(torch.empty(r, num_blocks, in_channels // num_blocks, hc // num_blocks))
        else:
            self.weight = nn.Parameter(torch.empty(r, in_channels, hc))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.num_bases is not None:
            glorot_(self.basis)
            glorot_(self.att)
        else:
            glorot_(self.weight)
        glorot_(self.q)
        glorot_(self.k)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def relation_weights(self) -> torch.Tensor:
        """(R, in, H*out) dense weights of every relation (basis-combined, or the block-diagonal blocks laid out)."""
        if self.num_bases is not None:
            return (self.att @ self.basis.view(self.num_bases, -1)).view(-1, self.in_channels,
                                                                       self.heads * self.out_channels)
        if self.num_blocks is not None:
            return torch.stack([torch.block_diag(*w.unbind(0)) for w in self.weight.unbind(0)])
        return self.weight

    def forward(self, graph: Any, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, num_dst = hetero_inputs(graph, x, self.edge_types, self.in_channels)
        hh, c = self.heads, self.out_channels
        out: dict[str, torch.Tensor] = {}
        w_all = wq_all = x_all = None
        for t, n in num_dst.items():
            if n == 0 or t not in x:
                continue
            into = relations_into(graph, t)
            if not into.edge_types:
                h = x[t].new_zeros(n, hh * c if self.concat else c)
                out[t] = h + self.bias if self.bias is not None else h
                continue
            if w_all is None:
                w_all = self.relation_weights()                             # (R, in, H*C)
                wq_all = torch.matmul(w_all, self.q)                        # (R, in, H): W_r q folded
            ids = [self.rel_id[et] for et in into.edge_types]
            r_t = len(ids)
            if x_all is None:
                x_all = concat_inputs(graph, x)
            table = compact_linear(into, x_all, [w_all[i] for i in ids])       # (sum U_r, H*C): each (node, relation) once
            k_src = table @ self.k                                          # (sum U_r, H)
            wq = wq_all[ids[0]] if r_t == 1 else torch.cat([wq_all[i] for i in ids], 1)   # (in, R_t*H)
            q_dst = (x[t][:n] @ wq).view(n * r_t, hh)                      # row d*R_t + r
            score = (q_dst.index_select(0, into.query_rows)
                     + k_src.index_select(0, into.csr.indices))             # (E, H)
            alpha = edge_softmax(into.csr, F.leaky_relu(score, self.negative_slope))
            alpha = F.dropout(alpha, p=self.dropout, training=self.training)
            h = aggregate(into.csr, table.view(-1, hh, c), "sum", edge_weight=alpha)  # (n, H, C), float32 sums
            h = h.reshape(n, hh * c) if self.concat else h.mean(1)
            out[t] = h + self.bias if self.bias is not None else h
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}, num_relations={len(self.edge_types)}"

