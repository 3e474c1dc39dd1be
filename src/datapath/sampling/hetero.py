"""`HeteroNeighborSampler`: uniform multi-hop sampling over a `HeteroGraph`, per relation, into `HeteroBlock`s.

Each hop samples every relation into the frontier's node types with the homogeneous sampler's
draw (``kernels/sample.cu`` on the GPU, its vectorized twin on the CPU; the relation's index
salts the random key), then relabels per node type in first-occurrence order: a type's
destinations first, then the sources each relation brought, in relation order.  On the GPU a
hop's samples stay padded (``k`` slots per row) until one host read brings every type's and
relation's size: one wait per hop.  The CPU and GPU paths give identical blocks for the same
seed and step.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from datapath._runtime import kernels
from datapath._runtime.pinned import fetch_to_host
from datapath.graph.hetero import EdgeType, HeteroGraph, HeteroGraphError
from datapath.memory import host_of
from datapath.sampling import _rng
from datapath.sampling.errors import SamplingError
from datapath.sampling.hetero_block import HeteroBlock, RelationBlock
from datapath.sampling.neighbor_sampler import _THREADS, _cpu_positions, _kernel_views, check_fanouts
from datapath.sampling.relabel import relabel, relabel_dense

Fanouts = Sequence[int] | Mapping[Any, Sequence[int]]
_OWNER = "HeteroNeighborSampler"


class HeteroNeighborSampler:
    """Samples ``fanouts`` neighbours per node and relation at each hop from typed seeds.

    Args:
        fanouts: a list ``[15, 10]`` (every relation, per hop, seeds first) or a dict
            ``{relation: [per hop]}`` keyed by the ``(src, name, dst)`` triple or a unique relation
            name, naming every relation of the graph, all lists of one length.  ``-1``: all neighbours.
        replace: sample with replacement.
        seed: base seed; a sample is a pure function of (seed, step, graph, seeds).
        blocks_per_sm: grid of the GPU kernel, as for `NeighborSampler`.

    `sample` returns one `HeteroBlock` per hop, input layer first; ``blocks[-1]``'s destinations are the seeds.
    """

    def __init__(self, fanouts: Fanouts, replace: bool = False, seed: int = 0, blocks_per_sm: int = 32) -> None:
        if isinstance(fanouts, Mapping):
            if not fanouts:
                raise SamplingError("fanouts must name at least one relation")
            self.fanouts: list[int] | dict[Any, list[int]] = {
                k: check_fanouts(v, f"fanouts[{k!r}]", _OWNER) for k, v in fanouts.items()}
            hops = {len(v) for v in self.fanouts.values()}
            if len(hops) != 1:
                raise SamplingError(f"every relation needs the same number of hops, got lengths {sorted(hops)}")
            self.num_hops = hops.pop()
        else:
            self.fanouts = check_fanouts(fanouts, "fanouts", _OWNER)
            self.num_hops = len(self.fanouts)
        self.replace = bool(replace)
        self.seed = int(seed)
        if int(blocks_per_sm) < 1:
            raise SamplingError(f"blocks_per_sm must be >= 1, got {blocks_per_sm}")
        self.blocks_per_sm = int(blocks_per_sm)

    def __repr__(self) -> str:
        return f"HeteroNeighborSampler(fanouts={self.fanouts}, replace={self.replace}, seed={self.seed})"

    def relation_fanouts(self, graph: HeteroGraph) -> dict[EdgeType, list[int]]:
        """``{edge_type: [fanout per hop]}`` for ``graph`` (``-1`` resolved to the relation's largest degree)."""
        if isinstance(self.fanouts, list):
            per = {et: list(self.fanouts) for et in graph.edge_types}
        else:
            per = {}
            for k, v in self.fanouts.items():
                try:
                    et = graph.edge_type(k)
                except HeteroGraphError as exc:
                    raise SamplingError(f"fanouts: {exc}") from exc
                per[et] = list(v)
            missing = [et for et in graph.edge_types if et not in per]
            if missing:
                raise SamplingError(f"fanouts name no fanout for the relations {missing}; give every relation one "
                                    f"(0 is not allowed: drop the relation from the graph instead)")
        for et, fs in per.items():
            for i, f in enumerate(fs):
                if f == -1:
                    if self.replace:
                        raise SamplingError("fanout -1 (all neighbours) cannot be combined with replace=True")
                    fs[i] = max(graph.relations[et].max_in_degree(), 1)
        return per

    def sample(self, graph: HeteroGraph, seeds: Mapping[str, torch.Tensor] | tuple[str, torch.Tensor], *,
               step: int = 0) -> list[HeteroBlock]:
        """Blocks for typed ``seeds`` (``{node_type: (B_t,) distinct ids}`` or ``(node_type, ids)``), input layer first.

        CUDA seeds sample on the GPU from a unified or cuda graph; CPU seeds on the CPU from a cpu or
        unified graph.  Seeds are bounds-checked against their type (one host read per type).
        """
        if not isinstance(graph, HeteroGraph):
            raise SamplingError(f"HeteroNeighborSampler samples a HeteroGraph, got {type(graph).__name__}")
        if isinstance(seeds, tuple):
            seeds = {seeds[0]: seeds[1]}
        if not isinstance(seeds, Mapping) or not seeds:
            raise SamplingError("seeds must be {node_type: ids} or (node_type, ids)")
        checked = {}
        for t, ids in seeds.items():
            if not isinstance(ids, torch.Tensor):
                raise SamplingError(f"seeds of node type {t!r} must be a 1-D tensor")
            try:
                graph.check_ids(t, ids, "seeds")
            except HeteroGraphError as exc:
                raise SamplingError(str(exc)) from exc
            checked[t] = ids.long()
        devices = {v.device.type for v in checked.values()}
        if len(devices) != 1:
            raise SamplingError(f"all seeds must be on one device, got {sorted(devices)}")
        return self._sample(graph, checked, step)

    def _sample(self, graph: HeteroGraph, seeds: dict[str, torch.Tensor], step: int) -> list[HeteroBlock]:
        """`sample` for int64 seeds known to be in range."""
        dev = next(iter(seeds.values())).device
        if dev.type == "cuda" and graph.placement not in ("unified", "cuda"):
            raise SamplingError(
                f"GPU sampling reads the graph from unified or cuda memory, but it is in {graph.placement!r}; "
                f"call graph.to('unified') once, or pass CPU seeds")
        if dev.type != "cuda" and graph.placement == "cuda":
            raise SamplingError("the graph is in GPU memory but the seeds are on the CPU; pass CUDA seeds")
        fan = self.relation_fanouts(graph)
        rel_index = {et: i for i, et in enumerate(graph.edge_types)}
        frontier = {t: seeds[t].contiguous() if t in seeds else torch.empty(0, dtype=torch.int64, device=dev)
                    for t in graph.node_types}
        blocks = []
        for hop in range(self.num_hops):
            base = _rng.derive_key(self.seed, step, hop)
            sampled: dict[EdgeType, Any] = {}
            for et in graph.edge_types:
                dst = frontier[et[2]]
                if dst.numel() == 0:
                    continue
                key = _rng.mix64_int(base ^ (rel_index[et] + 1))
                if dev.type == "cuda":
                    sampled[et] = self._relation_gpu(graph.relations[et], dst, fan[et][hop], key)
                else:
                    sampled[et] = _relation_cpu(graph.relations[et], dst, fan[et][hop], self.replace, key)
            relabel_hop = _relabel_gpu if dev.type == "cuda" else _relabel_cpu
            blocks.append(relabel_hop(graph, frontier, sampled, fan, hop))
            frontier = blocks[-1].src_nodes
        blocks.reverse()
        return blocks

    def _relation_gpu(self, graph: Any, dst: torch.Tensor, k: int, key: int) -> "_Padded":
        """``dst``'s sampled in-edges by ``sample.cu``, left padded (``k`` slots per row; nothing waits)."""
        dev = dst.device
        indptr, indices, _ = _kernel_views(graph)
        suffix = f"i{32 if indptr.dtype == torch.int32 else 64}_i{32 if indices.dtype == torch.int32 else 64}"
        fn = kernels.get_function("sample.cu", f"sample_neighbors_{suffix}")
        cap = dst.numel()
        n_dev = torch.full((1,), cap, dtype=torch.int64, device=dev)
        out_nbr = torch.empty(cap * k, dtype=torch.int64, device=dev)
        out_cnt = torch.empty(cap, dtype=torch.int64, device=dev)
        grid = max(1, min(-(-cap // (_THREADS // 32)), kernels.multiprocessor_count(dev.index) * self.blocks_per_sm))
        kernels.launch(fn, grid, _THREADS, (
            kernels.ptr(indptr), kernels.ptr(indices), np.uint64(0), kernels.ptr(dst), kernels.ptr(n_dev),
            np.int64(cap), np.int32(k), np.int32(self.replace), np.uint64(key), kernels.ptr(out_nbr),
            np.uint64(0), kernels.ptr(out_cnt), np.uint64(0)))
        ptr = torch.zeros(cap + 1, dtype=torch.int64, device=dev)
        torch.cumsum(out_cnt, 0, out=ptr[1:])
        slot = torch.arange(k, device=dev)
        valid = (slot[None, :] < out_cnt[:, None]).reshape(-1)  # a row's sampled neighbours fill its first slots
        return _Padded(ptr, out_nbr, valid, (ptr[:-1, None] + slot[None, :]).reshape(-1))


class _Padded(NamedTuple):
    """A relation's sample on the GPU before its size is known: ``k`` slots per destination row."""

    indptr: torch.Tensor     # (n+1,) int64 CSR offsets of the compact sample
    nbrs: torch.Tensor       # (n*k,) int64 global source ids, valid where ``valid``
    valid: torch.Tensor      # (n*k,) bool
    position: torch.Tensor   # (n*k,) int64 each valid slot's place in the compact sample


def _relabel_gpu(graph: HeteroGraph, frontier: dict[str, torch.Tensor], sampled: dict[EdgeType, _Padded],
                 fan: dict[EdgeType, list[int]], hop: int) -> HeteroBlock:
    """One hop's `HeteroBlock` from the padded samples, with one host read (every type's and relation's size)."""
    dev = next(iter(frontier.values())).device
    parts_of: dict[str, list[EdgeType]] = {t: [et for et in sampled if et[0] == t] for t in graph.node_types}
    relabeled: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t, ets in parts_of.items():
        if not ets:
            continue
        keys = torch.cat([frontier[t]] + [sampled[et].nbrs for et in ets])
        valid = torch.cat([torch.ones(frontier[t].numel(), dtype=torch.bool, device=dev)]
                          + [sampled[et].valid for et in ets])
        relabeled[t] = relabel(keys, valid)
    sizes = [relabeled[t][2] for t in relabeled] + [sampled[et].indptr[-1:] for et in sampled]
    host = fetch_to_host(torch.cat(sizes)) if sizes else []  # the hop's one wait, GIL released
    n_unique = dict(zip(relabeled, host[:len(relabeled)]))
    n_edges = dict(zip(sampled, host[len(relabeled):]))
    src_nodes: dict[str, torch.Tensor] = {}
    local_of: dict[EdgeType, torch.Tensor] = {}
    for t, ets in parts_of.items():
        if t not in relabeled:
            src_nodes[t] = frontier[t]  # no relation brings sources of this type: its destinations only
            continue
        local, unique, _ = relabeled[t]
        src_nodes[t] = unique[:n_unique[t]]
        off = frontier[t].numel()
        for et in ets:
            pad = sampled[et]
            e, slots = n_edges[et], pad.nbrs.numel()
            out = torch.empty(e + 1, dtype=torch.int64, device=dev)  # invalid slots land in the spare last entry
            out.scatter_(0, torch.where(pad.valid, pad.position, e), local[off:off + slots])
            local_of[et] = out[:e]
            off += slots
    rels = {et: RelationBlock(sampled[et].indptr, local_of[et], src_nodes[et[0]].numel(), frontier[et[2]].numel(),
                              max_degree=fan[et][hop]) for et in sampled}
    return HeteroBlock(src_nodes, {t: frontier[t].numel() for t in graph.node_types}, rels)


def _relabel_cpu(graph: HeteroGraph, frontier: dict[str, torch.Tensor],
                 sampled: dict[EdgeType, tuple[torch.Tensor, torch.Tensor]], fan: dict[EdgeType, list[int]],
                 hop: int) -> HeteroBlock:
    """The CPU twin of `_relabel_gpu` (compact samples, numpy relabel): the same block."""
    src_nodes: dict[str, torch.Tensor] = {}
    local_of: dict[EdgeType, torch.Tensor] = {}
    for t in graph.node_types:
        parts = [frontier[t]] + [sampled[et][1] for et in sampled if et[0] == t]
        keys = torch.cat(parts) if len(parts) > 1 else parts[0]
        loc, uniq = relabel_dense(keys.numpy(), _scratch(graph.num_nodes[t]))
        local, unique = torch.from_numpy(loc), torch.from_numpy(uniq)
        src_nodes[t] = unique
        off = parts[0].numel()
        for et in sampled:
            if et[0] == t:
                e = sampled[et][1].numel()
                local_of[et] = local[off:off + e]
                off += e
    rels = {et: RelationBlock(sampled[et][0], local_of[et], src_nodes[et[0]].numel(), frontier[et[2]].numel(),
                              max_degree=fan[et][hop]) for et in sampled}
    return HeteroBlock(src_nodes, {t: frontier[t].numel() for t in graph.node_types}, rels)


_LOCAL = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's (>= n,) int64 scratch of -1 for `relabel_dense` (left all -1 after each use)."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or buf.size < n:
        buf = _LOCAL.scratch = np.full(n, -1, dtype=np.int64)
    return buf


def _relation_cpu(graph: Any, dst: torch.Tensor, k: int, replace: bool, key: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin of `HeteroNeighborSampler._relation_gpu`."""
    indptr = host_of(graph.indptr).numpy()
    indices = host_of(graph.indices).numpy()
    pos, ptr = _cpu_positions(indptr, dst.numpy().astype(np.int64, copy=False), k, replace, key)
    return torch.from_numpy(ptr), torch.from_numpy(indices[pos].astype(np.int64, copy=False))
