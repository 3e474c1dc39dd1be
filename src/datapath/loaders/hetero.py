"""`HeteroNeighborLoader`: typed mini-batches (HeteroBlocks, each node type's features from its own table).

A thin composition: `datapath.sampling.HeteroNeighborSampler` samples the batch (on the GPU from a
unified or cuda `HeteroGraph`), and each node type's input rows are fetched from that type's own
table -- a `datapath.features.FeatureStore` (GPU cache / pinned host / disk) or a tensor (unified:
zero-copy gather; cuda; cpu) -- by the same ``fetch_rows`` as `NeighborLoader`.  The batches are
made by the same background producer as `NeighborLoader`'s (``loaders/_prefetch.py``): on the GPU
one stream samples (queued two batches ahead), one gathers every type's rows over PCIe without
anyone waiting for it, one runs the ``prepare`` hook; the consumer's stream waits on the batch's
events and the tensors are ``record_stream``-ed.

    loader = HeteroNeighborLoader(hg, ("paper", train_idx), [15, 10], batch_size=1024,
                                  features={"paper": store_p, "author": store_a}, labels=y_paper)
    for batch in loader:
        out = model(batch.blocks, batch.x)             # x: {node_type: (N_src_t, F_t)}
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from datapath.graph.hetero import HeteroGraph, HeteroGraphError
from datapath.loaders._batch_steps import BatchSteps, GatherStream, Started, Stopwatch, run_prepare
from datapath.loaders._prefetch import PrefetchIter
from datapath.loaders.batch import Batch, GatherCheck
from datapath.loaders.errors import LoaderError
from datapath.loaders.loader import Table, fetch_rows
from datapath.memory import ErrorFlag, host_of
from datapath.sampling import HeteroBlock, HeteroNeighborSampler, SamplingError


@dataclass
class HeteroBatch(Batch):
    """One typed mini-batch (a `Batch` whose blocks and features are per node type).

    Attributes:
        blocks: one `HeteroBlock` per layer, input layer first.
        x: ``{node_type: (blocks[0].num_src_nodes[t], F_t)}`` input rows of the types that have a table.
        y: (B,) labels of the seeds, or None.
        seeds: (B,) int64 per-type ids of the seeds (of ``input_type``).
        input_type: the seeds' node type.
        sample_s / gather_s / producer_cpu_s / producer_gpu_wait_s: as for `Batch`.
    """

    blocks: list[HeteroBlock]  # type: ignore[assignment]
    x: dict[str, torch.Tensor]  # type: ignore[assignment]
    input_type: str = ""

    def tensors(self) -> list[torch.Tensor]:
        out = [t for b in self.blocks for t in b.tensors()] + [self.seeds, *self.x.values(), *self._prepared]
        return out + ([self.y] if self.y is not None else [])

    @property
    def input_nodes(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """``{node_type: (N_in,) int64}`` ids of the nodes whose features form ``x``."""
        return self.blocks[0].src_nodes


class _Sampled:
    """A typed sample already built (the typed sampler waits for its sizes at each hop); ``event`` (GPU) is
    recorded behind its kernels, for the streams that read it."""

    def __init__(self, blocks: list[HeteroBlock], event: torch.cuda.Event | None) -> None:
        self._blocks, self.event = blocks, event

    def blocks(self) -> list[HeteroBlock]:
        return self._blocks


class HeteroNeighborLoader:
    """Iterates over typed ``seeds`` in batches: samples `HeteroBlock`s, fetches each type's rows and the labels.

    Args:
        graph: the `HeteroGraph` (unified or cuda for GPU sampling).
        seeds: ``(node_type, ids)``: distinct ids of the type to train on.
        sampler: a `HeteroNeighborSampler`, or its fanouts (a list, or a dict per relation).
        batch_size / shuffle / drop_last / seed: as for `NeighborLoader`.
        features: ``{node_type: table}``, each a `FeatureStore` or a tensor (unified, cuda, cpu) of
            (num_nodes[t], F_t) rows; types without a table get no ``x`` entry.
        labels: (num_nodes[input_type],) labels, a tensor or a `FeatureStore`.
        device: where batches go (cuda when available).
        prefetch: batches each background thread prepares ahead (0: in the calling thread).
        num_workers: background threads, each with CUDA streams of its own, batches dealt round-robin and
            handed over in order.
        prepare: called with each batch in the producer (e.g. a model's ``prepare_batch``), on a stream of
            its own after the batch's sampling; the tensors it returns travel with the batch.  ``x`` and ``y``
            may still be being gathered then (GPU work reading them follows ``batch.wait_for_inputs()``).
        stream_priority: CUDA priority of the sampling and prepare streams (as for `NeighborLoader`).
        gather_stream: where the GPU producer gathers the rows: ``"own"`` (a stream of its own: the typed
            sampler waits for its sizes at every hop, and a gather queued behind on its stream would hold
            those waits up by its PCIe reads; the default), ``"sample"`` (queued on the sampling stream) or
            ``"serial"`` (each batch made whole and waited for: no pipelining, for A/B measurements).
    """

    def __init__(self, graph: HeteroGraph, seeds: tuple[str, torch.Tensor],
                 sampler: HeteroNeighborSampler | Sequence[int] | Mapping[Any, Sequence[int]],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *,
                 features: Mapping[str, Table] | None = None, labels: Table | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 num_workers: int = 1, prepare: Callable[[HeteroBatch], Any] | None = None,
                 stream_priority: int = 0, gather_stream: GatherStream = "own") -> None:
        if not isinstance(graph, HeteroGraph):
            raise LoaderError(f"HeteroNeighborLoader loads a HeteroGraph, got {type(graph).__name__}")
        if not isinstance(sampler, HeteroNeighborSampler):
            sampler = HeteroNeighborSampler(sampler, seed=seed)
        if batch_size < 1 or prefetch < 0 or num_workers < 1:
            raise LoaderError(f"batch_size and num_workers must be >= 1 and prefetch >= 0, got {batch_size}, "
                              f"{num_workers} and {prefetch}")
        if gather_stream not in ("sample", "own", "serial"):
            raise LoaderError(f"gather_stream must be 'sample', 'own' or 'serial', got {gather_stream!r}")
        if not (isinstance(seeds, tuple) and len(seeds) == 2):
            raise LoaderError("seeds must be (node_type, ids)")
        t, ids = seeds
        ids = torch.as_tensor(ids)
        try:
            graph.check_ids(t, ids, "seeds")
            self.features = graph.check_features(features or {}, "features")
            sampler.relation_fanouts(graph)  # fanouts naming a relation the graph lacks fail here, not in a thread
        except (HeteroGraphError, SamplingError) as exc:
            raise LoaderError(str(exc)) from exc
        ids = ids.to("cpu", torch.int64)
        if torch.unique(ids).numel() != ids.numel():
            raise LoaderError("seeds contain duplicates; pass each node once (torch.unique(ids))")
        if labels is not None and labels.shape[0] != graph.num_nodes[t]:
            raise LoaderError(f"labels have {labels.shape[0]} rows but node type {t!r} has {graph.num_nodes[t]} nodes")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.graph, self.sampler, self.labels = graph, sampler, labels
        self.input_type, self.seeds = t, ids
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), shuffle, drop_last
        self.seed, self.prefetch, self.prepare = int(seed), int(prefetch), prepare
        self.num_workers, self.stream_priority = int(num_workers), int(stream_priority)
        self.gather_stream: GatherStream = gather_stream
        self.sample_device = (self.device if self.device.type == "cuda" and graph.placement in ("unified", "cuda")
                              else torch.device("cpu"))
        self.epoch = 0
        self._streams: dict[int, tuple[torch.cuda.Stream, ...]] = {}  # per worker, kept across epochs
        self._iterators: weakref.WeakSet[PrefetchIter] = weakref.WeakSet()

    def __len__(self) -> int:
        n = self.seeds.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def close(self) -> None:
        """Stop and join the producer threads of every epoch still being iterated (idempotent)."""
        for it in list(self._iterators):
            it.close()

    def _batches(self) -> list[tuple[torch.Tensor, int]]:
        epoch = self.epoch
        self.epoch += 1
        order = self.seeds
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = order[torch.randperm(order.numel(), generator=gen)]
        return [(order[i * self.batch_size:(i + 1) * self.batch_size], epoch * len(self) + i) for i in range(len(self))]

    def __iter__(self) -> Iterator[HeteroBatch]:
        work = self._batches()
        if self.prefetch == 0:
            return (self.make(seeds, step) for seeds, step in work)
        steps = BatchSteps(make=self._make, start=self._start, collect=self._collect, prepare=self._prepare,
                           abort=None, device=self.device, workers=self.num_workers, depth=self.prefetch,
                           gather_stream=self.gather_stream, stream_priority=self.stream_priority,
                           streams=self._streams)
        it = PrefetchIter(steps, work)
        self._iterators.add(it)
        return it

    # -- one batch (the steps the producer runs) ---------------------------------------------------
    def make(self, seeds_cpu: torch.Tensor, step: int) -> HeteroBatch:
        """Sample, fetch and prepare one batch on the current stream, and wait for it."""
        return self._make(seeds_cpu, step)

    def _make(self, seeds_cpu: torch.Tensor, step: int, schedule: Any = None, defer: bool = False) -> HeteroBatch:
        batch = self._collect(self._start(seeds_cpu, step), None)
        self._prepare(batch, None)
        if batch._events:
            batch._events[-1].synchronize()
        return batch

    def _start(self, seeds_cpu: torch.Tensor, step: int) -> Started:
        """Sample one batch on the current stream (the typed sampler waits for its sizes once per hop)."""
        sw = Stopwatch()
        seeds = seeds_cpu.to(self.sample_device, non_blocking=True)
        blocks = self.sampler._sample(self.graph, {self.input_type: seeds}, step)
        event = None
        if self.sample_device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Started(seeds, step, _Sampled(blocks, event), sw.wall(), sw.cpu(), sw.wait())

    def _rows(self, blocks: list[HeteroBlock], seeds: torch.Tensor, flag: ErrorFlag | None
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Every type's input rows and the seeds' labels, on ``device`` (queued on the current stream)."""
        x = {}
        for t, table in self.features.items():
            rows = fetch_rows(table, blocks[0].src_nodes[t], flag)
            x[t] = rows.to(self.device, non_blocking=True) if rows.device != self.device else rows
        y = fetch_rows(self.labels, seeds, flag) if self.labels is not None else None
        if y is not None and y.device != self.device:
            y = y.to(self.device, non_blocking=True)
        return x, y

    def _collect(self, st: Started, gather_stream: torch.cuda.Stream | None, schedule: Any = None,
                 defer: bool = False) -> HeteroBatch:
        """Fetch ``st``'s rows and labels: with ``gather_stream`` (the GPU producer) launched there after the
        sample and not waited for (its bounds check is read later, `GatherCheck`)."""
        sw = Stopwatch()
        blocks, seeds = st.pending.blocks(), st.seeds
        events: list[torch.cuda.Event] = []
        check = None
        if gather_stream is not None and self.sample_device.type == "cuda":
            gather_stream.wait_event(st.pending.event)
            with torch.cuda.stream(gather_stream):
                flag = ErrorFlag()
                x, y = self._rows(blocks, seeds, flag)
                for t in self.features:
                    blocks[0].src_nodes[t].record_stream(gather_stream)
                seeds.record_stream(gather_stream)
                events.append(torch.cuda.Event(blocking=True))
                events[-1].record(gather_stream)
                check = GatherCheck(events[-1], flag, st.step)
        else:
            x, y = self._rows(blocks, seeds, None)
            if self.device != self.sample_device:
                blocks = [b.to(self.device) for b in blocks]
                seeds = seeds.to(self.device)
        if check is not None:  # the batch's sampling (its sampling stream may hold later batches' by now)
            events.append(st.pending.event)
        elif self.device.type == "cuda":  # everything this stream did for the batch (sampled and gathered here)
            events.append(torch.cuda.Event(blocking=True))
            events[-1].record()
        batch = HeteroBatch(blocks, x, y, seeds, sample_s=st.sample_s, gather_s=sw.wall(),
                            producer_cpu_s=st.cpu_s + sw.cpu(), producer_gpu_wait_s=st.wait_s + sw.wait(),
                            input_type=self.input_type)
        batch._events, batch._check = events, check
        batch._sampled = st.pending.event if st.pending.event is not None else (events[-1] if events else None)
        return batch

    def _prepare(self, batch: HeteroBatch, prepare_stream: torch.cuda.Stream | None) -> None:
        run_prepare(self.prepare, batch, prepare_stream, self.device)


def hetero_hotness(graph: HeteroGraph, seeds: tuple[str, torch.Tensor], sampler: HeteroNeighborSampler, *,
                   batch_size: int = 1024, batches: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """``{node_type: (N_t,) int64}``: how many of ``batches`` presampled batches read each node's row (a
    `FeatureStore`'s ``hotness`` per type), ties broken by how often the node is a source of some relation.

    One scale for every type (``reads * S + degree``, ``S`` above every type's largest degree), so scores
    compare across types too: `hetero_cache_rows` ranks all of them for one GPU cache budget.
    """
    gpu = torch.cuda.is_available() and graph.placement in ("unified", "cuda")
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    t, ids = seeds
    order = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed + 7919))]
    counts = {nt: torch.zeros(n, dtype=torch.int64, device=dev) for nt, n in graph.num_nodes.items()}
    for i in range(min(batches, -(-order.numel() // batch_size))):
        part = order[i * batch_size:(i + 1) * batch_size].to(dev)
        blocks = sampler._sample(graph, {t: part}, (1 << 40) + i)
        for nt, src in blocks[0].src_nodes.items():
            counts[nt][src] += 1
    degs = {}
    for nt in graph.node_types:
        deg = torch.zeros(graph.num_nodes[nt], dtype=torch.int64)
        for et, g in graph.relations.items():
            if et[0] == nt:  # how often the node is some relation's source
                idx = host_of(g.indices) if g.placement == "unified" else g.indices
                deg += torch.bincount(idx.long(), minlength=graph.num_nodes[nt]).cpu()
        degs[nt] = deg
    scale = 1 + max((int(d.max()) for d in degs.values() if d.numel()), default=0)
    return {nt: counts[nt].cpu() * scale + degs[nt] for nt in graph.node_types}


def hetero_cache_rows(hotness: Mapping[str, torch.Tensor], row_bytes: Mapping[str, int], budget_bytes: int
                      ) -> dict[str, int]:
    """``{node_type: rows}`` to cache on the GPU: one budget spread over the types' tables by hotness per byte.

    Args:
        hotness: ``{node_type: (N_t,) scores}`` on one scale for every type (`hetero_hotness`).
        row_bytes: ``{node_type: bytes of one row}`` of the types with a table (the others get none).
        budget_bytes: the GPU cache of all the tables together.

    The rows are taken hottest-per-byte first over all types until the budget is spent, so a small
    type read by every batch (IGBH's institutes and fields of study) is cached whole before the cold
    rows of a large one.  Each type's `FeatureStore` caches its own hottest rows: pass
    ``gpu_cache=rows[t] * row_bytes[t]`` and ``hotness=hotness[t]``.
    """
    types = [t for t in row_bytes if t in hotness and hotness[t].numel()]
    missing = [t for t in row_bytes if t not in hotness]
    if missing:
        raise LoaderError(f"hotness has no scores for node type {missing[0]!r}; give every type with a table one")
    if budget_bytes < 0:
        raise LoaderError(f"the GPU cache budget must be >= 0 bytes, got {budget_bytes}")
    out = {t: 0 for t in row_bytes}
    if not types or budget_bytes == 0:
        return out
    per_byte = torch.cat([hotness[t].double() / max(int(row_bytes[t]), 1) for t in types])
    cost = torch.cat([torch.full((hotness[t].numel(),), int(row_bytes[t]), dtype=torch.int64) for t in types])
    kind = torch.cat([torch.full((hotness[t].numel(),), i, dtype=torch.int64) for i, t in enumerate(types)])
    order = torch.argsort(per_byte, descending=True, stable=True)
    take = int(torch.searchsorted(torch.cumsum(cost[order], 0), budget_bytes, right=True))
    rows = torch.bincount(kind[order[:take]], minlength=len(types)).tolist()
    out.update(zip(types, rows))
    return out
