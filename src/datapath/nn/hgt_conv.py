"""Heterogeneous graph transformer convolution (Hu et al.; PyG's ``HGTConv``), compactly materialised."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._hetero_inputs import EdgeType, hetero_inputs
from datapath.ops import aggregate, edge_softmax, sddmm
from datapath.ops.typed import compact_linear, relations_into


class _DictLinear(nn.Module):
    """One ``nn.Linear`` per node type under ``lins`` (PyG's ``HeteroDictLinear`` layout)."""

    def __init__(self, in_channels: Mapping[str, int], out_channels: int) -> None:
        super().__init__()
        self.lins = nn.ModuleDict({t: nn.Linear(c, out_channels) for t, c in in_channels.items()})


class _TypedWeight(nn.Module):
    """A (types, in, out) weight under ``weight`` (PyG's ``HeteroLinear`` without bias)."""

    def __init__(self, types: int, cin: int, cout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(types, cin, cout))


class HGTConv(nn.Module):
    """HGT: per node type ``k, q, v = x W_{kqv,t}``; per relation ``k_r = k W^k_r``, ``v_r = v W^v_r`` (per head);
    ``alpha = softmax over every incoming edge of (q_i . k_r,j) * p_r / sqrt(D)``;
    ``out_i = s_t * A_t(gelu(sum alpha v_r,j)) + (1 - s_t) x_i`` with ``s_t = sigmoid(skip_t)`` (the skip
    only where out width == in width).

    Args:
        in_channels: input width, one for every type or ``{node_type: width}``.
        out_channels: output width F (divisible by ``heads``).
        metadata: ``(node_types, edge_types)`` (`HeteroGraph.metadata`).
        heads: attention heads H (D = F / H).

    PyG's parameter names and shapes (``kqv_lin.lins.<type>``, ``out_lin.lins.<type>``, ``k_rel.weight``,
    ``v_rel.weight`` of (H*R, D, D) indexed ``h*R + r``, ``skip.<type>``, ``p_rel.<src__name__dst>``), so a
    PyG ``HGTConv`` state dict loads as is.  ``forward(graph, x)`` as for `RGCNConv`; outputs for the
    destination types that some relation reaches.

    Compact materialisation: the relation transforms are folded into the node-type linear
    (``W_{k,t} W^k_r``, and ``p_r / sqrt(D)`` into it), applied once per distinct (source, relation);
    one `sddmm` / `edge_softmax` / `aggregate` over the relations merged per destination type.
    """

    def __init__(self, in_channels: int | Mapping[str, int], out_channels: int,
                 metadata: tuple[Sequence[str], Sequence[EdgeType]], heads: int = 1) -> None:
        super().__init__()
        if out_channels % heads:
            raise ValueError(f"out_channels ({out_channels}) must be divisible by heads ({heads})")
        node_types, edge_types = list(metadata[0]), [tuple(et) for et in metadata[1]]
        if not isinstance(in_channels, Mapping):
            in_channels = {t: in_channels for t in node_types}
        self.in_channels, self.out_channels, self.heads = dict(in_channels), out_channels, heads
        self.node_types, self.edge_types = node_types, edge_types
        self.rel_id = {et: i for i, et in enumerate(edge_types)}
        self.dst_node_types = {et[2] for et in edge_types}
        d = out_channels // heads
        self.kqv_lin = _DictLinear(self.in_channels, 3 * out_channels)
        self.out_lin = _DictLinear({t: out_channels for t in node_types}, out_channels)
        self.k_rel = _TypedWeight(heads * len(edge_types), d, d)
        self.v_rel = _TypedWeight(heads * len(edge_types), d, d)
        self.skip = nn.ParameterDict({t: nn.Parameter(torch.empty(1)) for t in node_types})
        self.p_rel = nn.ParameterDict({"__".join(et): nn.Parameter(torch.empty(1, heads)) for et in edge_types})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (*self.kqv_lin.lins.values(), *self.out_lin.lins.values()):
            lin.reset_parameters()
        for w in (self.k_rel.weight, self.v_rel.weight):
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
        for p in (*self.skip.values(), *self.p_rel.values()):
            nn.init.ones_(p)

    def _folded(self, src: str, et: EdgeType, part: int, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(in, F) weight and (F,) bias of ``x -> (x W_{part,src} + b) W_rel`` per head (part 0: k, 2: v)."""
        f, hh = self.out_channels, self.heads
        d = f // hh
        lin = self.kqv_lin.lins[src]
        w = lin.weight[part * f:(part + 1) * f].t().reshape(-1, hh, d)      # (in, H, D)
        b = lin.bias[part * f:(part + 1) * f].view(hh, d)                   # (H, D)
        rel = (self.k_rel if part == 0 else self.v_rel).weight
        r, nr = self.rel_id[et], len(self.edge_types)
        wr = rel[torch.arange(hh, device=rel.device) * nr + r]              # (H, D, D)
        if scale is not None:
            wr = wr * scale.view(hh, 1, 1)
        w = torch.einsum("ihd,hde->ihe", w, wr).reshape(-1, f)
        b = torch.einsum("hd,hde->he", b, wr).reshape(f)
        return w, b

    def forward(self, graph: Any, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, num_dst = hetero_inputs(graph, x, self.edge_types)
        f, hh = self.out_channels, self.heads
        d = f // hh
        out: dict[str, torch.Tensor] = {}
        for t, n in num_dst.items():
            if n == 0 or t not in x or t not in self.dst_node_types:
                continue
            x_dst = x[t][:n]
            lin = self.kqv_lin.lins[t]
            q = F.linear(x_dst, lin.weight[f:2 * f], lin.bias[f:2 * f]).view(n, hh, d)
            into = relations_into(graph, t)
            if into.edge_types:
                kw, kb, vw, vb = [], [], [], []
                for et in into.edge_types:
                    scale = self.p_rel["__".join(et)].view(hh) / math.sqrt(d)
                    w, b = self._folded(et[0], et, 0, scale)
                    kw.append(w)
                    kb.append(b)
                    w, b = self._folded(et[0], et, 2, None)
                    vw.append(w)
                    vb.append(b)
                k = compact_linear(into, x, kw, kb).view(-1, hh, d)     # (sum U_r, H, D): per (node, relation)
                v = compact_linear(into, x, vw, vb).view(-1, hh, d)
                alpha = edge_softmax(into.csr, sddmm(into.csr, q, k, op="dot"))   # (E, H)
                h = aggregate(into.csr, v, "sum", edge_weight=alpha).reshape(n, f)  # float32 sums
            else:
                h = x_dst.new_zeros(n, f)
            a = self.out_lin.lins[t](F.gelu(h))
            if a.shape[-1] == x_dst.shape[-1]:
                s = self.skip[t].sigmoid()
                a = s * a + (1 - s) * x_dst
            out[t] = a
        return out

    def extra_repr(self) -> str:
        return f"-1, {self.out_channels}, heads={self.heads}, num_relations={len(self.edge_types)}"
