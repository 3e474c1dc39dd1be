"""Graph attention convolution (Velickovic et al.), multi-head, on sddmm / edge_softmax / aggregate."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._inputs import layer_inputs
from datapath.ops import aggregate, edge_softmax, sddmm


class GATConv(nn.Module):
    """GAT: ``alpha_ij = softmax_j(LeakyReLU(a_dst . W x_i + a_src . W x_j))``, ``out_i = sum_j alpha_ij W x_j``.

    Args:
        in_channels: input width (or a pair ``(src, dst)`` of widths for bipartite inputs).
        out_channels: width per head.
        heads: attention heads H.
        concat: concatenate the heads (output H*out) or average them (output out).
        negative_slope: LeakyReLU slope.
        dropout: dropout on the attention coefficients (training only).
        bias: learnable bias.

    PyG's parameter names (``lin``, ``att_src``, ``att_dst``, ``bias``; ``lin_src``/``lin_dst``
    for a pair of widths). ``forward(graph, x, src_ids=None)``: x (num_src, in) or
    ``(x_src, x_dst)``; a fused ``src_ids`` table is gathered first (attention projects
    every source row). Returns (num_dst, H*out) or (num_dst, out).
    """

    def __init__(self, in_channels: int | tuple[int, int], out_channels: int, heads: int = 1,
                 concat: bool = True, negative_slope: float = 0.2, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.negative_slope, self.dropout = concat, negative_slope, dropout
        if isinstance(in_channels, int):
            self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
            self.lin_src = self.lin_dst = None
        else:
            self.lin = None
            self.lin_src = nn.Linear(in_channels[0], heads * out_channels, bias=False)
            self.lin_dst = nn.Linear(in_channels[1], heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(heads * out_channels if concat else out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.lin, self.lin_src, self.lin_dst):
            if lin is not None:
                nn.init.xavier_uniform_(lin.weight)
        for att in (self.att_src, self.att_dst):
            bound = math.sqrt(6.0 / (att.shape[-2] + att.shape[-1]))
            nn.init.uniform_(att, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                src_ids: torch.Tensor | None = None) -> torch.Tensor:
        inp = layer_inputs(graph, x, src_ids, self.in_channels)
        h_, c = self.heads, self.out_channels
        x_src = inp.materialized_src()
        paired = isinstance(x, tuple)
        if self.lin is not None:
            hs = self.lin(x_src).view(-1, h_, c)
            hd = self.lin(inp.x_dst).view(-1, h_, c) if paired else hs[: inp.csr.num_dst]
        else:
            hs = self.lin_src(x_src).view(-1, h_, c)
            hd = self.lin_dst(inp.x_dst).view(-1, h_, c)
        a_src = (hs * self.att_src).sum(-1)               # (num_src, H)
        a_dst = (hd * self.att_dst).sum(-1)               # (num_dst, H)
        scores = F.leaky_relu(sddmm(inp.csr, a_dst, a_src, op="add"), self.negative_slope)  # (E, H)
        alpha = edge_softmax(inp.csr, scores)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = aggregate(inp.csr, hs, "sum", edge_weight=alpha)  # (num_dst, H, C)
        out = out.reshape(-1, h_ * c) if self.concat else out.mean(1)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}"
