"""Float64 CPU references of the typed (heterogeneous) ops and relational layers the fuzz checks, written from the
definitions (per-relation edge lists, accurately rounded sums of `datapath.testing.fuzz_reference`), sharing no
code with `datapath.ops.typed` or the layers: what `datapath.testing.fuzz_typed` compares them with.

A typed graph is given as `TypedEdges`: per relation ``(src_type, name, dst_type)`` its ``src`` / ``dst`` int64
edge lists in CSR order (rows are destinations, ids per type), and per node type its source and destination
counts.  The layer references read the float64 CPU copy of the layer's parameters (PyG's names and shapes) and
follow PyG's ``RGCNConv``, ``RGATConv`` (additive self-attention across relations) and ``HGTConv``
(`tests/fuzz/test_fuzz_typed.py` checks that they agree with PyG's layers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from datapath.testing import fuzz_reference as ref
from datapath.testing.fuzz_graphs import edge_lists

F64 = torch.float64
EdgeType = tuple[str, str, str]


@dataclass
class TypedEdges:
    """Edge lists of a `HeteroGraph` / `HeteroBlock` on the CPU, relations in the graph's order."""

    src: dict[EdgeType, torch.Tensor]
    dst: dict[EdgeType, torch.Tensor]
    num_src: dict[str, int]
    num_dst: dict[str, int]

    @classmethod
    def of(cls, graph: Any) -> "TypedEdges":
        src, dst = {}, {}
        for et, r in graph.relations.items():
            src[et], dst[et] = edge_lists(r)
        if hasattr(graph, "src_nodes"):
            return cls(src, dst, dict(graph.num_src_nodes), dict(graph.num_dst_nodes))
        return cls(src, dst, dict(graph.num_nodes), dict(graph.num_nodes))

    def into(self, t: str) -> list[EdgeType]:
        return [et for et in self.src if et[2] == t]

    def type_offsets(self) -> dict[str, int]:
        off, acc = {}, 0
        for t, n in self.num_src.items():
            off[t] = acc
            acc += n
        return off


@dataclass
class Merged:
    """What `datapath.ops.typed.relations_into` must give for one destination type, from the definition:
    relation r's ``sources`` (sorted distinct ids it reads, or all of its source type), and per merged edge its
    destination row, relation id (position in ``edge_types``) and column of the concatenated compact table."""

    edge_types: list[EdgeType]
    sources: list[torch.Tensor]
    offsets: list[int]
    edge_dst: torch.Tensor
    edge_rel: torch.Tensor
    edge_col: torch.Tensor
    edge_src: torch.Tensor
    table_rows: torch.Tensor


def merged(e: TypedEdges, t: str, compact: bool) -> Merged:
    """`Merged` of the relations into ``t``; edges in no particular order (compare as multisets)."""
    ets = e.into(t)
    off_t = e.type_offsets()
    sources, offsets, dsts, rels, cols, srcs, rows = [], [0], [], [], [], [], []
    for r, et in enumerate(ets):
        s = e.src[et]
        src = torch.unique(s) if compact else torch.arange(e.num_src[et[0]])
        pos = torch.searchsorted(src, s)
        sources.append(src)
        dsts.append(e.dst[et])
        rels.append(torch.full_like(s, r))
        cols.append(pos + offsets[-1])
        srcs.append(s + off_t[et[0]])
        rows.append(src + off_t[et[0]])
        offsets.append(offsets[-1] + src.numel())
    z = torch.zeros(0, dtype=torch.int64)
    cat = lambda v: torch.cat(v) if v else z  # noqa: E731
    return Merged(ets, sources, offsets, cat(dsts), cat(rels), cat(cols), cat(srcs), cat(rows))


def typed_linear(xs: list[torch.Tensor], ws: list[torch.Tensor], bs: list[torch.Tensor | None] | None
                 ) -> torch.Tensor:
    """``cat_i(xs[i] @ ws[i] + bs[i])``."""
    outs = [x @ w + (bs[i] if bs is not None and bs[i] is not None else 0) for i, (x, w) in enumerate(zip(xs, ws))]
    return torch.cat(outs)


def _rgcn_weights(conv: Any) -> torch.Tensor:
    """(R, in, out) dense relation weights of an R-GCN layer's float64 parameters."""
    if conv.num_bases is not None:
        return (conv.comp @ conv.weight.reshape(conv.num_bases, -1)).reshape(-1, conv.in_channels, conv.out_channels)
    if conv.num_blocks is not None:
        return torch.stack([torch.block_diag(*w.unbind(0)) for w in conv.weight.unbind(0)])
    return conv.weight


def rgcn(e: TypedEdges, x: dict[str, torch.Tensor], conv: Any) -> dict[str, torch.Tensor]:
    """R-GCN: ``x_i W_root + b + sum_r mean_{j in N_r(i)} x_j W_r`` for each type with destinations and inputs."""
    w = _rgcn_weights(conv)
    out = {}
    for t, n in e.num_dst.items():
        if n == 0 or t not in x:
            continue
        h = x[t][:n] @ conv.root if conv.root is not None else torch.zeros(n, conv.out_channels, dtype=F64)
        if conv.bias is not None:
            h = h + conv.bias
        for et in e.into(t):
            m = ref.aggregate(e.src[et], e.dst[et], n, x[et[0]], "mean")
            h = h + m @ w[conv.rel_id[et]]
        out[t] = h
    return out


def _rgat_weights(conv: Any) -> torch.Tensor:
    hc = conv.heads * conv.out_channels
    if conv.num_bases is not None:
        return (conv.att @ conv.basis.reshape(conv.num_bases, -1)).reshape(-1, conv.in_channels, hc)
    if conv.num_blocks is not None:
        return torch.stack([torch.block_diag(*w.unbind(0)) for w in conv.weight.unbind(0)])
    return conv.weight


def _rgat_scores(e: TypedEdges, x: dict[str, torch.Tensor], conv: Any, t: str, n: int, w: torch.Tensor
                 ) -> tuple[list, list, list, list]:
    """Per relation into ``t``: (pre-activation scores (E_r, H), their terms' magnitudes, dst, messages)."""
    hh, c = conv.heads, conv.out_channels
    scores, mags, dsts, msgs = [], [], [], []
    for et in e.into(t):
        wr = w[conv.rel_id[et]]
        hs, hd = x[et[0]] @ wr, x[t][:n] @ wr
        s, d = e.src[et], e.dst[et]
        scores.append(ref.gather(hd @ conv.q, d) + ref.gather(hs @ conv.k, s))
        with torch.no_grad():  # every product the score sums, under either association
            aw = wr.abs()
            mags.append((x[t][:n].abs() @ (aw @ conv.q.abs())).index_select(0, d)
                        + (x[et[0]].abs() @ (aw @ conv.k.abs())).index_select(0, s))
        dsts.append(d)
        msgs.append(ref.gather(hs.reshape(-1, hh, c), s))
    return scores, mags, dsts, msgs


def rgat(e: TypedEdges, x: dict[str, torch.Tensor], conv: Any) -> dict[str, torch.Tensor]:
    """R-GAT (PyG's defaults): ``softmax over every (j, r) -> i of LeakyReLU(x_i W_r q + x_j W_r k)``, then
    ``sum alpha x_j W_r`` per head, heads concatenated or averaged, plus the bias."""
    w = _rgat_weights(conv)
    hh, c = conv.heads, conv.out_channels
    out = {}
    for t, n in e.num_dst.items():
        if n == 0 or t not in x:
            continue
        if not e.into(t):
            h = torch.zeros(n, hh * c if conv.concat else c, dtype=F64)
        else:
            scores, _, dsts, msgs = _rgat_scores(e, x, conv, t, n, w)
            dst = torch.cat(dsts)
            alpha = ref.edge_softmax(dst, n, F.leaky_relu(torch.cat(scores), conv.negative_slope))
            h = ref.scatter_sum(dst, torch.cat(msgs) * alpha.unsqueeze(-1), n)
            h = h.reshape(n, hh * c) if conv.concat else h.mean(1)
        out[t] = h + conv.bias if conv.bias is not None else h
    return out


def rgat_kinks(e: TypedEdges, x: dict[str, torch.Tensor], conv: Any, u: float) -> dict[str, torch.Tensor]:
    """Per type, (num_dst,) bool: destinations with an edge whose score lies within ``4 u`` of the magnitude of
    its terms (every product ``|x| |W| |q|`` it sums) of LeakyReLU's kink at 0 (see `fuzz_reference.gat_kinks`:
    a kernel rounding the score may land on the other slope; such rows are left out of gradient comparisons)."""
    with torch.no_grad():
        w = _rgat_weights(conv)
        xd = {t: v.detach() for t, v in x.items()}
        out = {}
        for t, n in e.num_dst.items():
            if n == 0 or t not in x:
                continue
            mask = torch.zeros(n, dtype=torch.bool)
            if e.into(t):
                scores, mags, dsts, _ = _rgat_scores(e, xd, conv, t, n, w)
                for s, m, d in zip(scores, mags, dsts):
                    near = (s.abs() <= 4 * u * m).any(1)
                    mask.index_fill_(0, d[near], True)
            out[t] = mask
        return out


def hgt(e: TypedEdges, x: dict[str, torch.Tensor], conv: Any) -> dict[str, torch.Tensor]:
    """HGT (PyG's ``HGTConv``): per type ``k, q, v``; per relation and head ``k W^k_{h R + r}``, ``v W^v_{h R + r}``;
    ``softmax over every incoming edge of (q_i . k_j) p_r / sqrt(D)``; ``out_lin(gelu(sum alpha v))`` with the
    sigmoid-gated skip where the widths agree."""
    f, hh = conv.out_channels, conv.heads
    d = f // hh
    nr = len(conv.edge_types)
    out = {}
    for t, n in e.num_dst.items():
        if n == 0 or t not in x or t not in conv.dst_node_types:
            continue
        lin = conv.kqv_lin.lins[t]
        q = F.linear(x[t][:n], lin.weight[f:2 * f], lin.bias[f:2 * f]).reshape(n, hh, d)
        scores, dsts, msgs = [], [], []
        for et in e.into(t):
            ls = conv.kqv_lin.lins[et[0]]
            kqv = F.linear(x[et[0]], ls.weight, ls.bias)
            k, v = kqv[:, :f].reshape(-1, hh, d), kqv[:, 2 * f:].reshape(-1, hh, d)
            idx = torch.arange(hh) * nr + conv.rel_id[et]
            kr = torch.einsum("nhd,hde->nhe", k, conv.k_rel.weight[idx])
            vr = torch.einsum("nhd,hde->nhe", v, conv.v_rel.weight[idx])
            s, dd = e.src[et], e.dst[et]
            p = conv.p_rel["__".join(et)].reshape(hh)
            scores.append((ref.gather(q, dd) * ref.gather(kr, s)).sum(-1) * p / math.sqrt(d))
            dsts.append(dd)
            msgs.append(ref.gather(vr, s))
        if scores:
            dst = torch.cat(dsts)
            alpha = ref.edge_softmax(dst, n, torch.cat(scores))
            h = ref.scatter_sum(dst, torch.cat(msgs) * alpha.unsqueeze(-1), n).reshape(n, f)
        else:
            h = torch.zeros(n, f, dtype=F64)
        a = conv.out_lin.lins[t](F.gelu(h))
        if a.shape[-1] == x[t].shape[-1]:
            g = conv.skip[t].sigmoid()
            a = g * a + (1 - g) * x[t][:n]
        out[t] = a
    return out
