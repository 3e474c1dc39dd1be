"""Graph isomorphism network convolution (Xu et al.) on `datapath.ops.aggregate`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._inputs import layer_inputs
from datapath.nn._project_aggregate import fusable, project_aggregate
from datapath.ops import aggregate, prepare_aggregation


class GINConv(nn.Module):
    """GIN: ``out_i = nn((1 + eps) * x_i + sum_{j in N(i)} x_j)`` (PyG's parameter names).

    Args:
        nn: the update network applied to the combined rows (maps in -> out features).
        eps: initial epsilon.
        train_eps: learn epsilon (a parameter) instead of keeping it fixed (a buffer).
        aggr: ``"sum"`` (default), ``"mean"`` or ``"max"``.

    ``forward(graph, x, src_ids=None, edge_weight=None)`` as in `SAGEConv`.  When ``nn`` is a single
    ``Linear`` that narrows the rows, the rows are projected before the aggregation (exact: the
    layer is linear up to ``nn``'s output), so the aggregation moves ``out`` columns instead of ``in``.
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
        self.__dict__.pop("_one_plus_kept", None)  # .data writes do not move eps's version counter

    def _one_plus_eps(self) -> torch.Tensor:
        """``1 + eps``: kept while a fixed eps (a buffer) is unchanged, so a call launches no kernel for it."""
        eps = self.eps
        if isinstance(eps, torch.nn.Parameter) or (torch.is_grad_enabled() and eps.requires_grad):
            return 1 + eps
        # keyed by the buffer itself, its version counter (in-place writes) and its storage's address (``.data``
        # swaps): the buffer and its storage are held, so neither a replaced buffer nor a swapped-out storage can
        # have its id or address passed to a successor while the entry lives
        kept = self.__dict__.get("_one_plus_kept")
        if kept is None or kept[0] is not eps or kept[1] != eps._version or kept[3] != eps.data_ptr():
            if torch.is_inference_mode_enabled():  # an inference tensor: no later autograd call may save it
                return 1 + eps.detach()
            kept = (eps, eps._version, eps.untyped_storage(), eps.data_ptr(), 1 + eps.detach())
            self.__dict__["_one_plus_kept"] = kept
        return kept[4]

    @staticmethod
    def _in_width(net: nn.Module) -> int | None:
        """The width ``net`` takes where it says (a Linear, or a Sequential starting with one), else None."""
        # read through _modules, not indexing: a Sequential's [0] and a Module's attribute lookup cost per call
        first = next(iter(net._modules.values()), None) if isinstance(net, torch.nn.Sequential) else net
        return first.in_features if isinstance(first, torch.nn.Linear) else None

    def _projects_first(self, x_width: int, lin: nn.Module | None = None) -> bool:
        """``nn`` is one Linear not widening the rows: project, then aggregate (the same function, no more bytes)."""
        lin = self.nn if lin is None else lin
        return (self.aggr in ("sum", "mean") and isinstance(lin, torch.nn.Linear)
                and lin.in_features == x_width and lin.out_features <= lin.in_features)

    def prepare(self, graph: Any, dtype: torch.dtype = torch.float32, input_grad: bool = True) -> list[torch.Tensor]:
        """Precompute this layer's aggregation data for ``graph`` (see `datapath.ops.prepare_aggregation`)."""
        if self.aggr == "max":
            return []
        lin = self.nn
        if isinstance(lin, torch.nn.Linear) and self._projects_first(lin.in_features):
            return prepare_aggregation(graph, lin.out_features, dtype, backward=True, reduce=self.aggr)
        width = lin.in_features if isinstance(lin, torch.nn.Linear) else None
        if width is None:
            return []
        return prepare_aggregation(graph, width, dtype, backward=input_grad, reduce=self.aggr)

    def forward(self, graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                src_ids: torch.Tensor | None = None, edge_weight: torch.Tensor | None = None) -> torch.Tensor:
        net = self._modules["nn"]  # looked up once a call
        inp = layer_inputs(graph, x, src_ids, self._in_width(net))
        projects = not inp.fused and self._projects_first(inp.x_src.shape[-1], net)
        if projects and fusable(inp.x_src, edge_weight):
            lin = net  # the layer as one autograd node: AGG(x W^T) + (1 + eps) x_dst W^T + b
            pair = isinstance(x, tuple)
            return project_aggregate(inp.csr, inp.x_src, lin.weight, reduce=self.aggr, bias=lin.bias,
                                     root="own" if pair else "shared", x_dst=inp.x_dst if pair else None,
                                     root_weight=lin.weight if pair else None, scale=self._one_plus_eps())
        if projects:
            lin = net
            h_src = F.linear(inp.x_src, lin.weight)
            if isinstance(x, tuple):
                h_dst = F.linear(inp.x_dst, lin.weight)
            else:
                h_dst = h_src if h_src.shape[0] == inp.csr.num_dst else h_src[: inp.csr.num_dst]
            h = torch.addcmul(aggregate(inp.csr, h_src, self.aggr, edge_weight), h_dst, self._one_plus_eps())
            return h + lin.bias if lin.bias is not None else h
        h = aggregate(inp.csr, inp.x_src, self.aggr, edge_weight, src_ids=inp.src_ids)
        return net(torch.addcmul(h, inp.x_dst, self._one_plus_eps()))  # one kernel: the sum and the scaling

    def extra_repr(self) -> str:
        return f"aggr={self.aggr!r}"
