"""Graph isomorphism network convolution (Xu et al.) on `datapath.ops.aggregate`."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from datapath.nn._inputs import layer_inputs
from datapath.ops import aggregate


class GINConv(nn.Module):
    """GIN: ``out_i = nn((1 + eps) * x_i + sum_{j in N(i)} x_j)`` (PyG's parameter names).

    Args:
        nn: the update network applied to the combined rows (maps in -> out features).
        eps: initial epsilon.
        train_eps: learn epsilon (a parameter) instead of keeping it fixed (a buffer).
        aggr: ``"sum"`` (default), ``"mean"`` or ``"max"``.

    ``forward(graph, x, src_ids=None, edge_weight=None)`` as in `SAGEConv`.
    """

    def __init__(self, nn: nn.Module, eps: float = 0.0, train_eps: bool = False, aggr: str = "sum") -> None:  # noqa: A002
        super().__init__()
        self.nn = nn
        self.aggr = aggr
        self.initial_eps = eps
        if train_eps:
            self.eps = torch.nn.Parameter(torch.tensor([float(eps)]))
        else:
            self.register_buffer("eps", torch.tensor([float(eps)]))

    def reset_parameters(self) -> None:
        for m in self.nn.modules():
            if m is not self.nn and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self.eps.data.fill_(self.initial_eps)

    def forward(self, graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                src_ids: torch.Tensor | None = None, edge_weight: torch.Tensor | None = None) -> torch.Tensor:
        inp = layer_inputs(graph, x, src_ids)
        h = aggregate(inp.csr, inp.x_src, self.aggr, edge_weight, src_ids=inp.src_ids)
        return self.nn(h + (1 + self.eps) * inp.x_dst)

    def extra_repr(self) -> str:
        return f"aggr={self.aggr!r}"
