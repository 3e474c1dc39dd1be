"""GraphSAGE convolution on `datapath.ops.aggregate`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._inputs import layer_inputs
from datapath.nn._project_aggregate import fusable, project_aggregate
from datapath.ops import aggregate, prepare_aggregation


class SAGEConv(nn.Module):
    """GraphSAGE: ``out = lin_l(AGG_{j in N(i)} x_j) + lin_r(x_i)`` (Hamilton et al.; PyG's parameter names).

    Args:
        in_channels: input feature width.
        out_channels: output feature width.
        aggr: ``"mean"`` (default), ``"sum"`` or ``"max"``.
        bias: bias of ``lin_l``.
        root_weight: add ``lin_r(x_dst)``.
        normalize: L2-normalize the output rows.

    ``forward(graph, x, src_ids=None, edge_weight=None)``: ``graph`` a CSR of destination rows
    (`datapath.loaders.Graph`, a block, or ``(indptr, indices, num_src)``); ``x`` (num_src, in)
    or ``(x_src, x_dst)``; with ``src_ids`` (num_src,) CUDA ids, ``x`` is a unified/pinned/GPU
    feature table read in place by the fused kernel.  Returns (num_dst, out).
    For sum/mean with ``in_channels > out_channels`` the projection runs before the
    aggregation (same result, less traffic), except on the fused path.
    """

    def __init__(self, in_channels: int, out_channels: int, aggr: str = "mean", bias: bool = True,
                 root_weight: bool = True, normalize: bool = False) -> None:
        super().__init__()
        if aggr not in ("mean", "sum", "max"):
            raise ValueError(f"aggr must be 'mean', 'sum' or 'max', got {aggr!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.aggr, self.root_weight, self.normalize = aggr, root_weight, normalize
        self.lin_l = nn.Linear(in_channels, out_channels, bias=bias)
        self.lin_r = nn.Linear(in_channels, out_channels, bias=False) if root_weight else None

    def prepare(self, graph: Any, dtype: torch.dtype = torch.float32, input_grad: bool = True) -> list[torch.Tensor]:
        """Precompute this layer's aggregation schedules for ``graph`` (see `datapath.ops.prepare_aggregation`).

        ``dtype``: of the layer's input; ``input_grad``: whether the input will need a gradient.
        Returns the tensors cached on ``graph``.
        """
        if self.aggr == "max":
            return []
        if self.in_channels > self.out_channels:  # projected first: the aggregated rows need a gradient
            return prepare_aggregation(graph, self.out_channels, dtype, backward=True, reduce=self.aggr)
        return prepare_aggregation(graph, self.in_channels, dtype, backward=input_grad, reduce=self.aggr)

    def reset_parameters(self) -> None:
        self.lin_l.reset_parameters()
        if self.lin_r is not None:
            self.lin_r.reset_parameters()

    def forward(self, graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                src_ids: torch.Tensor | None = None, edge_weight: torch.Tensor | None = None) -> torch.Tensor:
        inp = layer_inputs(graph, x, src_ids, self.in_channels)
        if inp.fused:
            h = self.lin_l(aggregate(inp.csr, inp.x_src, self.aggr, edge_weight, src_ids=inp.src_ids))
        elif self.aggr != "max" and self.in_channels > self.out_channels and fusable(inp.x_src, edge_weight):
            pair = isinstance(x, tuple)  # the layer as one autograd node: AGG(x W_l^T) + x_dst W_r^T + b_l
            h = project_aggregate(inp.csr, inp.x_src, self.lin_l.weight, reduce=self.aggr, bias=self.lin_l.bias,
                                  root="none" if self.lin_r is None else "own", x_dst=inp.x_dst if pair else None,
                                  root_weight=None if self.lin_r is None else self.lin_r.weight)
            return F.normalize(h, p=2.0, dim=-1) if self.normalize else h
        elif self.aggr != "max" and self.in_channels > self.out_channels:
            h = aggregate(inp.csr, F.linear(inp.x_src, self.lin_l.weight), self.aggr, edge_weight)
            if self.lin_r is not None:  # the root term and lin_l's bias in one matmul: one kernel fewer
                h = h + F.linear(inp.x_dst, self.lin_r.weight, self.lin_l.bias)
            elif self.lin_l.bias is not None:
                h = h + self.lin_l.bias
            return F.normalize(h, p=2.0, dim=-1) if self.normalize else h
        else:
            h = self.lin_l(aggregate(inp.csr, inp.x_src, self.aggr, edge_weight))
        if self.lin_r is not None:
            h = h + self.lin_r(inp.x_dst)
        if self.normalize:
            h = F.normalize(h, p=2.0, dim=-1)
        return h

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}"
