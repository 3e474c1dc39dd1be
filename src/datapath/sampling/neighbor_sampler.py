"""`NeighborSampler`: uniform multi-hop neighbor sampling that builds message-flow blocks.

Sampling runs where the seeds are: CUDA seeds sample on the GPU (``kernels/sample.cu``)
from a graph in unified or cuda memory; CPU seeds sample on the CPU (vectorized numpy)
from a graph in cpu or unified memory.  Both paths draw the same counter-based
random numbers and relabel nodes in first-occurrence order, so for the same seed
and step they return identical blocks.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from datapath._runtime import kernels
from datapath._runtime.pinned import fetch_to_host
from datapath.graph import Graph
from datapath.memory import host_of, kernel_view
from datapath.sampling import _rng
from datapath.sampling._graphed import GraphCache
from datapath.sampling.block import Block
from datapath.sampling.errors import SamplingError
from datapath.sampling.relabel import relabel, relabel_dense

log = logging.getLogger("datapath.sampling")

_THREADS = 256
_MAX_DEGREE = 2**32 - 1


def _max_degree(graph: Graph) -> int:
    """Largest in-degree of ``graph`` (computed once per graph)."""
    return graph.max_in_degree()


def check_fanouts(fanouts: Any, what: str = "fanouts", owner: str = "NeighborSampler") -> list[int]:
    """``fanouts`` (neighbours per hop, seeds first; ``-1``: all) as a list of ints, else `SamplingError`
    naming ``what`` (the argument) and what is accepted; ``owner`` is the class named in the example."""
    if isinstance(fanouts, (int, np.integer)) and not isinstance(fanouts, bool):
        raise SamplingError(f"{what}={fanouts!r}: give one fanout per hop as a list, e.g. "
                            f"{owner}([{fanouts}]) for one hop or {owner}([10, 5]) for two")
    try:
        fanouts = list(fanouts) if not isinstance(fanouts, (str, bytes)) else [fanouts]
    except TypeError:
        raise SamplingError(f"{what} must be a list of ints (neighbours per hop, e.g. [10, 5]), got "
                            f"{fanouts!r}") from None
    if not fanouts or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) for f in fanouts):
        raise SamplingError(f"{what} must be a non-empty list of ints (neighbours per hop), got {fanouts!r}")
    fanouts = [int(f) for f in fanouts]
    if any(f == 0 or f < -1 for f in fanouts):
        raise SamplingError(f"{what} must be positive ints (or -1 for all), got {fanouts}")
    return fanouts


class NeighborSampler:
    """Samples ``fanouts[h]`` neighbours per node at hop ``h`` from the seeds, uniformly.

    Args:
        fanouts: neighbours per node for each hop, seeds first (PyG's ``num_neighbors``
            order): ``[15, 10, 5]`` takes 15 neighbours of each seed, 10 of each of those,
            then 5.  ``-1`` takes all neighbours at that hop.
        replace: sample with replacement (default: without; a node with fewer
            neighbours than the fanout then keeps all of them).
        seed: base seed; a sample is a pure function of (seed, step, graph, seeds).
        return_edge_ids: also fill ``Block.edge_ids`` (the graph's edge ids, or CSR positions).
        blocks_per_sm: grid of the GPU sampling kernel, in 256-thread blocks per multiprocessor
            (one warp per node, latency-bound on PCIe reads).  Fewer leave room on the GPU for a
            training step running beside the loader's stream.
        cuda_graphs: on the GPU, replay the launches of a batch from a CUDA graph captured once per batch size
            (`capture_cuda_graphs`; `NeighborLoader` captures as each epoch begins): the same blocks for a
            fraction of the host time a batch.  False launches every kernel from Python each batch.

    `sample` returns one `Block` per hop, **input layer first** (DGL's order):
    ``blocks[-1].dst_nodes`` are the seeds and ``blocks[0].src_nodes`` the nodes
    whose features the first layer reads.
    """

    def __init__(self, fanouts: Sequence[int], replace: bool = False, seed: int = 0,
                 return_edge_ids: bool = False, blocks_per_sm: int = 32, cuda_graphs: bool = True) -> None:
        self.fanouts = check_fanouts(fanouts)
        self.replace = bool(replace)
        self.seed = int(seed)
        self.return_edge_ids = bool(return_edge_ids)
        if int(blocks_per_sm) < 1:
            raise SamplingError(f"blocks_per_sm must be >= 1, got {blocks_per_sm}")
        self.blocks_per_sm = int(blocks_per_sm)
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = GraphCache()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"NeighborSampler(fanouts={self.fanouts}, replace={self.replace}, seed={self.seed})"

    def _fanout(self, graph: Graph, hop: int) -> int:
        f = self.fanouts[hop]
        if f == -1:
            if self.replace:
                raise SamplingError("fanout -1 (all neighbours) cannot be combined with replace=True")
            f = max(_max_degree(graph), 1)
        return f

    def sample(self, graph: Graph, seeds: torch.Tensor, *, step: int = 0) -> list[Block]:
        """Blocks for ``seeds`` ((B,) distinct int64 node ids), one per hop, input layer first.

        CUDA ``seeds``: sampled on the GPU from a unified or cuda graph; blocks on the GPU.
        CPU ``seeds``: sampled on the CPU from a cpu or unified graph; blocks on the CPU.
        ``step`` selects the random stream (the loader passes the batch number).
        Seeds are bounds-checked (one host sync on the GPU path); they must be distinct.
        """
        if not isinstance(seeds, torch.Tensor) or seeds.dim() != 1:
            raise SamplingError("seeds must be a 1-D tensor of node ids")
        if seeds.dtype not in (torch.int32, torch.int64):
            raise SamplingError(f"seeds must be int32 or int64, got {seeds.dtype}")
        seeds = seeds.long()
        if seeds.numel():  # one host sync; the loader checks its seeds once and calls _sample
            lo, hi = (int(v) for v in torch.aminmax(seeds))
            if lo < 0 or hi >= graph.num_nodes:
                raise SamplingError(f"seed ids range over [{lo}, {hi}] but the graph has {graph.num_nodes} nodes")
        return self._sample(graph, seeds, step)

    def _sample(self, graph: Graph, seeds: torch.Tensor, step: int) -> list[Block]:
        """`sample` for int64 seeds already known to be in range."""
        return self._launch(graph, seeds, step).blocks()

    def _launch(self, graph: Graph, seeds: torch.Tensor, step: int) -> "PendingSample":
        """Start `_sample` without waiting: on the GPU every kernel is queued on the current stream and
        ``.blocks()`` later waits for the sizes (once).  The loader does other work in between."""
        if _max_degree(graph) > _MAX_DEGREE:
            raise SamplingError(f"a node has degree {_max_degree(graph)} >= 2^32; the sampler cannot draw from it")
        if seeds.device.type == "cuda":
            return self._sample_gpu(graph, seeds.contiguous(), step)
        if graph.placement == "cuda":
            raise SamplingError("the graph is in GPU memory but the seeds are on the CPU; pass CUDA seeds")
        return PendingSample(blocks=self._sample_cpu(graph, seeds, step))

    def capture_cuda_graphs(self, graph: Graph, batch_sizes: Sequence[int], device: torch.device | str) -> bool:
        """Capture the GPU sampling of batches of these sizes from ``graph`` as CUDA graphs (``cuda_graphs``), so
        that `sample` replays one graph a batch instead of launching each kernel: the same blocks for a fraction of
        the host time.  A graph captured for B seeds serves batches of B/2 to B.  Call it where no other thread
        draws from the GPU's random generator at the same moment (torch marks the generator while it captures):
        `NeighborLoader` calls it as each epoch begins.  Returns False where nothing is captured (``cuda_graphs``
        off, a CPU device or graph, a capture that failed: sampling then launches its kernels)."""
        device = torch.device(device)
        if not self.cuda_graphs or device.type != "cuda" or graph.placement not in ("unified", "cuda"):
            return False
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if _max_degree(graph) > _MAX_DEGREE:
            return False
        hops = len(self.fanouts)
        keys = [0] * hops  # the captured launches read each batch's keys from device memory

        def queue(dst: torch.Tensor, cap: int, n_dev: torch.Tensor, dev_keys: torch.Tensor | None
                  ) -> tuple[torch.Tensor, list]:
            return self._queue(graph, dst, cap, n_dev, keys, dev_keys)

        ok = True
        for b in sorted({int(b) for b in batch_sizes}, reverse=True):
            with torch.cuda.device(device):
                ok = self._graphs.capture(graph, b, device, hops, queue, self._launch_config()) and ok
        return ok

    def _launch_config(self) -> tuple[Any, ...]:
        """The settings a captured graph's launches were made with (a graph made under others is not replayed)."""
        return (tuple(self.fanouts), self.replace, self.return_edge_ids, self.blocks_per_sm)

    # -- CPU ---------------------------------------------------------------------------------
    def _scratch(self, num_nodes: int) -> np.ndarray:
        """This thread's (num_nodes,) int64 relabel scratch, all -1 (kept between calls)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.size < num_nodes:
            buf = np.full(num_nodes, -1, dtype=np.int64)
            self._local.scratch = buf
        return buf

    def _sample_cpu(self, graph: Graph, seeds: torch.Tensor, step: int) -> list[Block]:
        indptr = host_of(graph.indptr).numpy()
        indices = host_of(graph.indices).numpy()
        eids = host_of(graph.edge_ids).numpy() if graph.edge_ids is not None else None
        dst = seeds.numpy().astype(np.int64, copy=False)
        scratch = self._scratch(graph.num_src_nodes)
        blocks: list[Block] = []
        for hop in range(len(self.fanouts)):
            k = self._fanout(graph, hop)
            key = _rng.derive_key(self.seed, step, hop)
            nbr_pos, ptr = _cpu_positions(indptr, dst, k, self.replace, key)
            nbr = indices[nbr_pos].astype(np.int64, copy=False)
            local, unique = relabel_dense(np.concatenate([dst, nbr]), scratch)
            e_ids = None
            if self.return_edge_ids:
                e_ids = torch.from_numpy(eids[nbr_pos].astype(np.int64) if eids is not None else nbr_pos)
            block = Block(torch.from_numpy(ptr), torch.from_numpy(local[dst.size:]), torch.from_numpy(unique),
                          dst.size, e_ids, trusted=True, max_degree=k)
            blocks.append(block)
            dst = block.src_nodes.numpy()
        blocks.reverse()
        return blocks

    # -- GPU ---------------------------------------------------------------------------------
    def _sample_gpu(self, graph: Graph, seeds: torch.Tensor, step: int) -> "PendingSample":
        if graph.placement not in ("unified", "cuda"):
            raise SamplingError(
                f"GPU sampling reads the graph from unified or cuda memory, but it is in {graph.placement!r}; "
                f"call graph.to('unified') once (pins in place), or pass CPU seeds"
            )
        keys = [_rng.derive_key(self.seed, step, hop) for hop in range(len(self.fanouts))]
        if self.cuda_graphs and seeds.numel():
            out = self._graphs.run(graph, seeds, keys, self._launch_config())
            if out is not None:
                return PendingSample(sizes=out[0], pending=out[1])
        n_dev = torch.full((1,), seeds.numel(), dtype=torch.int64, device=seeds.device)
        sizes, pending = self._queue(graph, seeds, seeds.numel(), n_dev, keys, None)
        return PendingSample(sizes=sizes, pending=pending)

    def _queue(self, graph: Graph, dst: torch.Tensor, cap: int, n_dev: torch.Tensor, keys: list[int],
               dev_keys: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        """Queue every hop's launches for seeds ``dst`` ((cap,) int64 CUDA, the first ``n_dev[0]`` valid), nothing
        waiting: ``(sizes, pending)`` for `PendingSample`.  Hop ``h`` draws with ``keys[h]``, or with the key the
        kernel reads from ``dev_keys[h]`` ((hops,) int64 on the device: a CUDA graph's input)."""
        dev = dst.device
        indptr, indices, eids = _kernel_views(graph)
        suffix = f"i{32 if indptr.dtype == torch.int32 else 64}_i{32 if indices.dtype == torch.int32 else 64}"
        fn = kernels.get_function("sample.cu", f"sample_neighbors_{suffix}")
        sms = kernels.multiprocessor_count(dev.index)
        pending = []  # (indptr_full, indices_buf, unique, eid_buf, fanout) per hop; sizes in `sizes`
        sizes: list[torch.Tensor] = []
        for hop in range(len(self.fanouts)):
            k = self._fanout(graph, hop)
            out_nbr = torch.empty(cap * k, dtype=torch.int64, device=dev)
            out_cnt = torch.empty(cap, dtype=torch.int64, device=dev)
            out_eid = torch.empty(cap * k, dtype=torch.int64, device=dev) if self.return_edge_ids else None
            if cap:
                warps_per_block = _THREADS // 32
                grid = max(1, min(-(-cap // warps_per_block), sms * self.blocks_per_sm))
                key_ptr = np.uint64(0) if dev_keys is None else np.uint64(dev_keys.data_ptr() + 8 * hop)
                kernels.launch(fn, grid, _THREADS, (
                    kernels.ptr(indptr), kernels.ptr(indices), kernels.ptr(eids) if eids is not None else np.uint64(0),
                    kernels.ptr(dst), kernels.ptr(n_dev), np.int64(cap), np.int32(k), np.int32(self.replace),
                    np.uint64(keys[hop]), kernels.ptr(out_nbr),
                    kernels.ptr(out_eid) if out_eid is not None else np.uint64(0), kernels.ptr(out_cnt), key_ptr))
            rows = torch.arange(cap, device=dev)
            valid_dst = rows < n_dev
            valid_nbr = torch.arange(k, device=dev)[None, :] < out_cnt[:, None]  # (cap, k)
            local, unique, count = relabel(torch.cat([dst, out_nbr]), torch.cat([valid_dst, valid_nbr.reshape(-1)]))
            indptr_full = torch.zeros(cap + 1, dtype=torch.int64, device=dev)
            torch.cumsum(out_cnt, 0, out=indptr_full[1:])
            slot = indptr_full[:-1, None] + torch.arange(k, device=dev)[None, :]
            slot = torch.where(valid_nbr, slot, cap * k).reshape(-1)
            idx_buf = torch.empty(cap * k + 1, dtype=torch.int64, device=dev)
            idx_buf.scatter_(0, slot, local[cap:])
            eid_buf = None
            if out_eid is not None:
                eid_buf = torch.empty(cap * k + 1, dtype=torch.int64, device=dev)
                eid_buf.scatter_(0, slot, out_eid)
            sizes += [n_dev, count, indptr_full.index_select(0, n_dev)]
            pending.append((indptr_full, idx_buf, unique, eid_buf, k))
            dst, cap, n_dev = unique, unique.numel(), count
        return torch.cat(sizes), pending


class PendingSample:
    """A sample whose GPU work may still be running; `blocks` waits for its sizes (once) and builds the blocks.

    ``event`` (GPU path) is recorded on the sampling stream after the last kernel: another stream
    that reads the blocks waits on it instead of on everything the sampling stream does next.
    """

    def __init__(self, blocks: list[Block] | None = None, sizes: torch.Tensor | None = None,
                 pending: list | None = None) -> None:
        self._blocks = blocks
        self._sizes = sizes
        self._pending = pending
        self.event = None
        if sizes is not None:
            self.event = torch.cuda.Event()
            self.event.record()

    def blocks(self) -> list[Block]:
        if self._blocks is None:
            host_sizes = fetch_to_host(self._sizes)  # the sample's one wait, GIL released
            blocks = []
            for hop, (indptr_full, idx_buf, unique, eid_buf, fanout) in enumerate(self._pending):
                n_dst, n_src, e = host_sizes[3 * hop: 3 * hop + 3]
                blocks.append(Block(indptr_full[: n_dst + 1], idx_buf[:e], unique[:n_src], n_dst,
                                    None if eid_buf is None else eid_buf[:e], trusted=True, max_degree=fanout))
            blocks.reverse()
            self._blocks, self._sizes, self._pending = blocks, None, None
        return self._blocks


def _kernel_views(graph: Graph) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CUDA views of the graph's CSR for the kernel (aliases of unified memory), made once per graph."""
    return graph.derived("kernel_views", lambda: (
        kernel_view(graph.indptr, "the graph's indptr"), kernel_view(graph.indices, "the graph's indices"),
        kernel_view(graph.edge_ids, "the graph's edge_ids") if graph.edge_ids is not None else None))


def _cpu_positions(indptr: np.ndarray, dst: np.ndarray, k: int, replace: bool, key: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """CSR positions of the sampled in-edges of ``dst`` (the CPU twin of ``sample.cu``).

    Returns ``(pos, ptr)``: ``pos`` (E,) int64 positions into ``indices``, grouped by
    destination in the kernel's order; ``ptr`` (len(dst)+1,) int64 block indptr.
    """
    start = indptr[dst].astype(np.int64)
    deg = indptr[dst + 1].astype(np.int64) - start
    if replace:
        cnt = np.where(deg > 0, k, 0)
    else:
        cnt = np.minimum(deg, k)
    ptr = np.zeros(dst.size + 1, dtype=np.int64)
    np.cumsum(cnt, out=ptr[1:])
    total = int(ptr[-1])
    row = np.repeat(np.arange(dst.size, dtype=np.int64), cnt)
    j = np.arange(total, dtype=np.int64) - ptr[row]
    state = _rng.node_state(key, dst)
    if replace:
        pos = _rng.draw_below(state[row], j.astype(np.uint64), deg[row])
    else:
        pos = j
        big = np.flatnonzero(deg > k)
        if big.size:
            chosen = _floyd(state[big], deg[big], k)
            big_slots = (ptr[big][:, None] + np.arange(k, dtype=np.int64)[None, :]).reshape(-1)
            pos[big_slots] = chosen.reshape(-1)
    return start[row] + pos, ptr


def _floyd(state: np.ndarray, deg: np.ndarray, k: int) -> np.ndarray:
    """(n, k) int64: Floyd's uniform k-subsets of ``range(deg)``, vectorized over n nodes."""
    chosen = np.empty((state.size, k), dtype=np.int64)
    for s in range(k):
        jj = deg - k + s
        t = _rng.draw_below(state, s, jj + 1)
        if s:
            taken = (chosen[:, :s] == t[:, None]).any(axis=1)
            t = np.where(taken, jj, t)
        chosen[:, s] = t
    return chosen
