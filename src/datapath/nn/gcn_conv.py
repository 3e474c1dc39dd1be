"""Graph convolution (Kipf & Welling) on `datapath.ops.aggregate`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._inputs import layer_inputs
from datapath.nn._project_aggregate import fusable, project_aggregate
from datapath.ops import add_self_loops as _add_self_loops
from datapath.ops import aggregate, prepare_aggregation


class GCNConv(nn.Module):
    """GCN: ``out_i = sum_{j in N(i)} w_ij x_j W / sqrt(deg_out(j) deg_in(i)) + b`` (PyG's parameter names).

    Args:
        in_channels: input feature width.
        out_channels: output feature width.
        normalize: apply the symmetric normalization (edge counts, clamped at 1); else a plain sum.
        add_self_loops: add an edge ``i -> i`` to every destination (cached on the graph). PyG adds
            them by default; here the default is False (blocks from a sampler usually carry their own).
        bias: learnable bias.

    ``forward(graph, x, src_ids=None, edge_weight=None)`` as in `SAGEConv`; returns (num_dst, out).
    The projection runs before the aggregation, except on the fused path (``src_ids``).
    """

    def __init__(self, in_channels: int, out_channels: int, normalize: bool = True,
                 add_self_loops: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.normalize, self.add_self_loops = normalize, add_self_loops
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def prepare(self, graph: Any, dtype: torch.dtype = torch.float32, input_grad: bool = True) -> list[torch.Tensor]:
        """Precompute this layer's aggregation data for ``graph`` (see `datapath.ops.prepare_aggregation`).

        The rows aggregated are the projected ones (``out_channels`` wide), which always need a
        gradient (the weight's).  Returns the tensors kept with the graph.
        """
        if self.add_self_loops:
            graph = _add_self_loops(graph)
        return prepare_aggregation(graph, self.out_channels, dtype, backward=True,
                                   norm="gcn" if self.normalize else None)

    def forward(self, graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                src_ids: torch.Tensor | None = None, edge_weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.add_self_loops:
            if edge_weight is not None:
                raise ValueError("GCNConv(add_self_loops=True) with edge weights is not supported; add the loops "
                                 "and their weights to the graph yourself")
            graph = _add_self_loops(graph)
        inp = layer_inputs(graph, x, src_ids, self.in_channels)
        norm = "gcn" if self.normalize else None
        if not inp.fused and fusable(inp.x_src, edge_weight):  # one autograd node for the layer
            return project_aggregate(inp.csr, inp.x_src, self.lin.weight, norm=norm, bias=self.bias)
        if inp.fused:
            h = self.lin(aggregate(inp.csr, inp.x_src, "sum", edge_weight, norm, src_ids=inp.src_ids))
        else:
            h = aggregate(inp.csr, F.linear(inp.x_src, self.lin.weight), "sum", edge_weight, norm)
        if self.bias is not None:
            h = h + self.bias
        return h

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, normalize={self.normalize}"
