"""Heterogeneous graph transformer convolution (Hu et al.; PyG's ``HGTConv``), compactly materialised."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn._hetero_inputs import EdgeType, RelationIds, hetero_inputs
from datapath.ops import aggregate, edge_softmax, sddmm
from datapath.ops.typed import compact_linear, concat_inputs, relations_into


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
        self.rel_id = RelationIds(edge_types)
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

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per relation r (S -> T): the (in, 2F) weight and (2F,) bias of ``x -> [k_r | v_r]``, i.e. the node-type
        linear ``x W_{k,S} + b`` followed by the relation's per-head ``W^k_r`` (scaled by ``p_r / sqrt(D)``), and
        likewise for v: (R, in, 2F), (R, 2F), all relations at once (None when the source widths differ)."""
        f, hh = self.out_channels, self.heads
        d, nr = f // hh, len(self.edge_types)
        srcs = [et[0] for et in self.edge_types]
        if len({self.in_channels[s] for s in srcs}) != 1:
            return None
        w = torch.stack([self.kqv_lin.lins[s].weight for s in srcs])            # (R, 3F, in)
        b = torch.stack([self.kqv_lin.lins[s].bias for s in srcs])              # (R, 3F)
        dev = w.device
        idx = torch.arange(hh, device=dev)[None, :] * nr + torch.arange(nr, device=dev)[:, None]  # (R, H): h*R + r
        scale = torch.stack([self.p_rel["__".join(et)].view(hh) for et in self.edge_types]) / math.sqrt(d)
        rk = self.k_rel.weight[idx] * scale[:, :, None, None]                  # (R, H, D, D)
        rv = self.v_rel.weight[idx]
        rel = torch.stack([rk, rv], 1)                                         # (R, 2, H, D, D)
        wkv = torch.stack([w[:, :f], w[:, 2 * f:]], 1).view(nr, 2, hh, d, -1)  # (R, 2, H, D, in)
        bkv = torch.stack([b[:, :f], b[:, 2 * f:]], 1).view(nr, 2, hh, 1, d)   # (R, 2, H, 1, D)
        fw = torch.matmul(wkv.transpose(-1, -2), rel)                          # (R, 2, H, in, D)
        fb = torch.matmul(bkv, rel)                                            # (R, 2, H, 1, D)
        return fw.permute(0, 3, 1, 2, 4).reshape(nr, -1, 2 * f), fb.reshape(nr, 2 * f)

    def _folded_one(self, et: EdgeType) -> tuple[torch.Tensor, torch.Tensor]:
        """`_folded` for one relation (sources of their own width)."""
        f, hh = self.out_channels, self.heads
        d, nr, r = f // hh, len(self.edge_types), self.rel_id[et]
        lin = self.kqv_lin.lins[et[0]]
        idx = torch.arange(hh, device=lin.weight.device) * nr + r
        scale = self.p_rel["__".join(et)].view(hh) / math.sqrt(d)
        ws, bs = [], []
        for part, rel in ((0, self.k_rel.weight[idx] * scale[:, None, None]), (2, self.v_rel.weight[idx])):
            w = lin.weight[part * f:(part + 1) * f].view(hh, d, -1).transpose(-1, -2)   # (H, in, D)
            ws.append(torch.matmul(w, rel).transpose(0, 1).reshape(-1, f))
            bs.append(torch.matmul(lin.bias[part * f:(part + 1) * f].view(hh, 1, d), rel).reshape(f))
        return torch.cat(ws, 1), torch.cat(bs)

    def forward(self, graph: Any, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, num_dst = hetero_inputs(graph, x, self.edge_types, self.in_channels)
        f, hh = self.out_channels, self.heads
        d = f // hh
        folded = x_all = None
        out: dict[str, torch.Tensor] = {}
        for t, n in num_dst.items():
            if n == 0 or t not in x or t not in self.dst_node_types:
                continue
            x_dst = x[t][:n]
            lin = self.kqv_lin.lins[t]
            q = F.linear(x_dst, lin.weight[f:2 * f], lin.bias[f:2 * f]).view(n, hh, d)
            into = relations_into(graph, t)
            if into.edge_types:
                if folded is None:
                    folded = self._folded() or False
                if folded:  # the relations into t picked at once (one gather, one backward node)
                    ids = self.rel_id.tensor(into.edge_types, folded[0].device)
                    ws = folded[0].index_select(0, ids).unbind(0)
                    bs = folded[1].index_select(0, ids).unbind(0)
                else:
                    ws, bs = zip(*(self._folded_one(et) for et in into.edge_types))
                if x_all is None:
                    same = len({v.shape[1] for v in x.values()}) == 1
                    x_all = concat_inputs(graph, x) if folded and same else x
                kv = compact_linear(into, x_all, ws, bs)                      # (sum U_r, 2F): per (node, relation) once
                k, v = (part.reshape(-1, hh, d) for part in kv.split(f, 1))
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
