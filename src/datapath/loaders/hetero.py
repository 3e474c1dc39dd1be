"""`HeteroNeighborLoader`: typed mini-batches (HeteroBlocks, each node type's features from its own table).

A thin composition: `datapath.sampling.HeteroNeighborSampler` samples the batch (on the GPU from a
unified or cuda `HeteroGraph`), and each node type's input rows are fetched from that type's own
table -- a `datapath.features.FeatureStore` (GPU cache / pinned host / disk) or a tensor (unified:
zero-copy gather; cuda; cpu) -- by the same ``fetch_rows`` as `NeighborLoader`.  A background
thread prepares the next batches on a CUDA stream of its own while the current one trains; the
consumer's stream waits on the batch's event and the tensors are ``record_stream``-ed.

    loader = HeteroNeighborLoader(hg, ("paper", train_idx), [15, 10], batch_size=1024,
                                  features={"paper": store_p, "author": store_a}, labels=y_paper)
    for batch in loader:
        out = model(batch.blocks, batch.x)             # x: {node_type: (N_src_t, F_t)}
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from datapath.graph.hetero import HeteroGraph, HeteroGraphError
from datapath.loaders.errors import LoaderError
from datapath.loaders.loader import Table, fetch_rows
from datapath.memory import host_of
from datapath.sampling import HeteroBlock, HeteroNeighborSampler

_DONE = object()


@dataclass
class HeteroBatch:
    """One typed mini-batch.

    Attributes:
        blocks: one `HeteroBlock` per layer, input layer first.
        x: ``{node_type: (blocks[0].num_src_nodes[t], F_t)}`` input rows of the types that have a table.
        y: (B,) labels of the seeds, or None.
        seeds: (B,) int64 per-type ids of the seeds (of ``input_type``).
        input_type: the seeds' node type.
        sample_s / gather_s: producer seconds spent sampling and fetching rows (and ``prepare``).
        wait_s: seconds the consumer waited for this batch (the producers' lag).
    """

    blocks: list[HeteroBlock]
    x: dict[str, torch.Tensor]
    y: torch.Tensor | None
    seeds: torch.Tensor
    input_type: str
    sample_s: float = 0.0
    gather_s: float = 0.0
    wait_s: float = 0.0
    _event: Any = field(default=None, repr=False)
    _prepared: list[torch.Tensor] = field(default_factory=list, repr=False)

    def tensors(self) -> list[torch.Tensor]:
        out = [t for b in self.blocks for t in b.tensors()] + [self.seeds, *self.x.values(), *self._prepared]
        return out + ([self.y] if self.y is not None else [])

    @property
    def input_nodes(self) -> dict[str, torch.Tensor]:
        """``{node_type: (N_in,) int64}`` ids of the nodes whose features form ``x``."""
        return self.blocks[0].src_nodes


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
        num_workers: background threads, each on a CUDA stream of its own, batches dealt round-robin and
            handed over in order (while one waits for the GPU in sampling, another gathers rows).
        prepare: called with each batch in the producer (e.g. a model's ``prepare_batch``); the
            tensors it returns travel with the batch.
    """

    def __init__(self, graph: HeteroGraph, seeds: tuple[str, torch.Tensor],
                 sampler: HeteroNeighborSampler | Sequence[int] | Mapping[Any, Sequence[int]],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *,
                 features: Mapping[str, Table] | None = None, labels: Table | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 num_workers: int = 1, prepare: Callable[[HeteroBatch], Any] | None = None) -> None:
        if not isinstance(graph, HeteroGraph):
            raise LoaderError(f"HeteroNeighborLoader loads a HeteroGraph, got {type(graph).__name__}")
        if not isinstance(sampler, HeteroNeighborSampler):
            sampler = HeteroNeighborSampler(sampler, seed=seed)
        if batch_size < 1 or prefetch < 0 or num_workers < 1:
            raise LoaderError(f"batch_size and num_workers must be >= 1 and prefetch >= 0, got {batch_size}, "
                              f"{num_workers} and {prefetch}")
        if not (isinstance(seeds, tuple) and len(seeds) == 2):
            raise LoaderError("seeds must be (node_type, ids)")
        t, ids = seeds
        ids = torch.as_tensor(ids)
        try:
            graph.check_ids(t, ids, "seeds")
            self.features = graph.check_features(features or {}, "features")
        except HeteroGraphError as exc:
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
        self.sample_device = (self.device if self.device.type == "cuda" and graph.placement in ("unified", "cuda")
                              else torch.device("cpu"))
        self.epoch = 0
        self.num_workers = int(num_workers)
        self._streams: list[torch.cuda.Stream] = []  # one per worker, kept across epochs

    def __len__(self) -> int:
        n = self.seeds.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _batches(self) -> list[tuple[torch.Tensor, int]]:
        epoch = self.epoch
        self.epoch += 1
        order = self.seeds
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = order[torch.randperm(order.numel(), generator=gen)]
        return [(order[i * self.batch_size:(i + 1) * self.batch_size], epoch * len(self) + i) for i in range(len(self))]

    def make(self, seeds_cpu: torch.Tensor, step: int) -> HeteroBatch:
        """Sample and fetch one batch on the current stream (its GPU work may still be running)."""
        t0 = time.perf_counter()
        seeds = seeds_cpu.to(self.sample_device, non_blocking=True)
        blocks = self.sampler._sample(self.graph, {self.input_type: seeds}, step)
        t1 = time.perf_counter()
        x = {}
        for t, table in self.features.items():
            rows = fetch_rows(table, blocks[0].src_nodes[t])
            x[t] = rows.to(self.device, non_blocking=True) if rows.device != self.device else rows
        y = fetch_rows(self.labels, seeds) if self.labels is not None else None
        if self.device != self.sample_device:
            blocks = [b.to(self.device) for b in blocks]
            seeds = seeds.to(self.device)
        if y is not None and y.device != self.device:
            y = y.to(self.device)
        batch = HeteroBatch(blocks, x, y, seeds, self.input_type, t1 - t0, time.perf_counter() - t1)
        if self.prepare is not None:
            batch._prepared = list(self.prepare(batch) or ())
            batch.gather_s = time.perf_counter() - t1
        return batch

    def __iter__(self) -> Iterator[HeteroBatch]:
        batches = self._batches()
        if self.prefetch == 0:
            for seeds, step in batches:
                yield self.make(seeds, step)
            return
        cuda = self.device.type == "cuda"
        workers = max(1, min(self.num_workers, len(batches)))
        while cuda and len(self._streams) < workers:
            self._streams.append(torch.cuda.Stream(self.device))
        queues: list[queue.Queue] = [queue.Queue(maxsize=self.prefetch) for _ in range(workers)]
        stop = threading.Event()

        def produce(w: int) -> None:  # batches w, w + W, w + 2W, ... on worker w's own stream
            q = queues[w]
            try:
                ctx = torch.cuda.stream(self._streams[w]) if cuda else contextlib.nullcontext()
                with ctx:
                    for seeds, step in batches[w::workers]:
                        if stop.is_set():
                            return
                        b = self.make(seeds, step)
                        if cuda:
                            b._event = torch.cuda.Event()
                            b._event.record(self._streams[w])
                        q.put(b)
                q.put(_DONE)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                q.put(exc)

        threads = [threading.Thread(target=produce, args=(w,), daemon=True, name=f"datapath-hetero-loader-{w}")
                   for w in range(workers)]
        for th in threads:
            th.start()
        try:
            for i in range(len(batches)):  # handed over in order: batch i from worker i % W
                t0 = time.perf_counter()
                item = queues[i % workers].get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                item.wait_s = time.perf_counter() - t0
                if item._event is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(item._event)
                    for t in item.tensors():
                        if t.device.type == "cuda":
                            t.record_stream(cur)
                yield item
        finally:
            stop.set()
            for q, th in zip(queues, threads):
                while th.is_alive():
                    try:
                        q.get(timeout=0.05)
                    except queue.Empty:
                        pass
                th.join()


def hetero_hotness(graph: HeteroGraph, seeds: tuple[str, torch.Tensor], sampler: HeteroNeighborSampler, *,
                   batch_size: int = 1024, batches: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """``{node_type: (N_t,) int64}``: how many of ``batches`` presampled batches read each node's row (a
    `FeatureStore`'s ``hotness`` per type; ties broken by in-degree over every relation into the type)."""
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
    out = {}
    for nt, c in counts.items():
        deg = torch.zeros(graph.num_nodes[nt], dtype=torch.int64)
        for et, g in graph.relations.items():
            if et[0] == nt:  # how often the node is some relation's source
                idx = host_of(g.indices) if g.placement == "unified" else g.indices
                deg += torch.bincount(idx.long(), minlength=graph.num_nodes[nt]).cpu()
        out[nt] = c.cpu() * (int(deg.max()) + 1 if deg.numel() else 1) + deg
    return out
