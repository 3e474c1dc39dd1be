"""`NeighborLoader`: mini-batches of sampled blocks with their input features and labels.

On a GPU, with the graph and features in unified memory, everything happens on the
GPU: the kernel samples from the pinned graph over PCIe, blocks are built on the GPU,
and the feature rows are gathered zero-copy (`datapath.unified_tensor.gather`).  A
background thread prepares batches on side CUDA streams while the current one trains:
the sampling of the batches `SAMPLE_AHEAD` ahead is queued before the thread waits for
a batch's sizes (its one host synchronisation), the gather is launched without waiting
(its bounds check is read later, from a pinned flag), and the ``prepare`` hook runs on
a third stream.  The consumer's stream waits on the batch's events and every tensor is
``record_stream``-ed, so the caching allocator never reuses memory still in use.

With the graph in CPU memory the sampling runs on the CPU (vectorized), features
are gathered by the CPU and copied to ``device``: the DGL/PyG default pipeline.
On a machine without CUDA the same API works with ``device="cpu"``.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from datapath._runtime.pinned import gpu_wait_seconds
from datapath.loaders._placement import _ut, gather_rows, placement_of
from datapath.loaders.block import Block
from datapath.loaders.errors import LoaderError
from datapath.loaders.graph import Graph
from datapath.loaders.sampler import NeighborSampler

log = logging.getLogger("datapath.loaders.loader")

SAMPLE_AHEAD = 2
"""Batches whose sampling the GPU producer keeps queued ahead of the one it prepares."""


@dataclass
class Batch:
    """One mini-batch.

    Attributes:
        blocks: one `Block` per layer, input layer first, on the loader's device.
        x: (blocks[0].num_src_nodes, F) input features, or None without ``features``.
        y: (B,) labels of the seeds, or None without ``labels``.
        seeds: (B,) int64 global ids of the seed nodes (``blocks[-1].dst_nodes``).
        producer_cpu_s / producer_gpu_wait_s: CPU time of the thread that made the batch while making it,
            and the part of its wall time it slept waiting for the GPU (host synchronisations); the rest
            of ``sample_s + gather_s`` it waited for the interpreter lock.
        sample_s / gather_s: wall seconds the producer spent sampling, and gathering plus the loader's
            ``prepare`` hook.  In the prefetching threads of the GPU path the gather is only launched (it
            runs on its own stream while the producer goes on), so ``gather_s`` is mostly ``prepare``.
    """

    blocks: list[Block]
    x: torch.Tensor | None
    y: torch.Tensor | None
    seeds: torch.Tensor
    sample_s: float = 0.0
    gather_s: float = 0.0
    producer_cpu_s: float = 0.0
    producer_gpu_wait_s: float = 0.0
    _events: list[torch.cuda.Event] = field(default_factory=list, repr=False)
    _check: "_GatherCheck | None" = field(default=None, repr=False)
    _sampled: torch.cuda.Event | None = field(default=None, repr=False)
    _prepared: list[torch.Tensor] = field(default_factory=list, repr=False)

    def tensors(self) -> list[torch.Tensor]:
        out = [t for b in self.blocks for t in b.tensors()] + [self.seeds] + self._prepared
        return out + [t for t in (self.x, self.y) if t is not None]

    def wait_for_inputs(self) -> None:
        """Make the current CUDA stream wait until ``x`` and ``y`` are gathered.

        Only needed inside a loader's ``prepare`` hook that launches GPU work reading ``x`` or
        ``y``: in the prefetching threads they are gathered on a stream of their own, concurrently
        with the hook (the consumer's stream waits for everything before it gets the batch).
        """
        if self._check is not None:
            torch.cuda.current_stream().wait_event(self._check.event)

    @property
    def input_nodes(self) -> torch.Tensor:
        """(N_in,) int64 ids of the nodes whose features form ``x``."""
        return self.blocks[0].src_nodes


class NeighborLoader:
    """Iterates over ``seeds`` in batches, sampling blocks and loading features and labels.

    Args:
        graph: the `Graph` (cpu, unified or cuda memory; unified or cuda for GPU sampling).
        seeds: (S,) distinct node ids to train on (int64/int32, any device).
        sampler: a `NeighborSampler` (or a list of fanouts).
        batch_size: seeds per batch.
        shuffle: a new permutation each epoch (seeded by ``seed`` and the epoch number).
        drop_last: skip the last incomplete batch.
        features: (N, F) node features: unified (zero-copy GPU gather), cuda, or cpu
            (CPU gather then copy).
        labels: (N,) node labels, placed like ``features``.
        device: where batches go: ``"cuda"`` or ``"cpu"``; default cuda when available.
        seed: seeds the shuffling and the sampler's random streams (with the epoch
            and batch number), so every run with the same seed sees the same batches.
        prefetch: batches prepared ahead by each background thread (0: prepare in the
            calling thread, on its current stream).
        num_workers: background threads preparing batches, each on its own CUDA streams (one samples
            and gathers features and labels, queued two batches ahead; one runs ``prepare``), batches
            dealt round-robin and handed over in order.  While one waits for the GPU (sampling
            and gathering over PCIe), another launches the next batch's work.
        prepare: called with each `Batch` in the producer (on the loader's stream, before the batch
            is handed over); the tensors it returns travel with the batch.  E.g. a `datapath.nn`
            model's ``prepare_batch``, which builds the aggregation schedules there so that the
            training thread launches only the step's own kernels.  It runs while ``x`` and ``y`` are still
            being gathered on another stream: their shapes and dtypes are there, but GPU work that
            reads them must follow ``batch.wait_for_inputs()``.
        stream_priority: CUDA priority of the loader's sampling and prepare streams (lower is higher;
            PyTorch's streams default to 0, the lowest).  High priority lets the loader's long-lived,
            PCIe-bound sampling and gather blocks take their SM slots while training runs.

    Sampling runs on the GPU when ``device`` is cuda and the graph is in unified or cuda
    memory; otherwise on the CPU.  Each ``iter(loader)`` is one epoch.
    """

    def __init__(self, graph: Graph, seeds: torch.Tensor, sampler: NeighborSampler | list[int],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *,
                 features: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 num_workers: int = 1, prepare: Callable[[Batch], Iterable[torch.Tensor] | None] | None = None,
                 stream_priority: int = 0) -> None:
        if not isinstance(sampler, NeighborSampler):
            sampler = NeighborSampler(sampler, seed=seed)
        if batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 0:
            raise LoaderError(f"prefetch must be >= 0, got {prefetch}")
        if num_workers < 1:
            raise LoaderError(f"num_workers must be >= 1, got {num_workers}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise LoaderError(f"device must be cpu or cuda, got {self.device}")
        self.graph = graph
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.prefetch = int(prefetch)
        self.num_workers = int(num_workers)
        self.stream_priority = int(stream_priority)
        self.prepare = prepare
        self._overlap_gather = True  # False: gather on the sampling stream and wait for it (A/B diagnostics)
        # "sample": the gather is queued on the sampling stream (PCIe used by one of them at a time);
        # "own": on a stream of its own, concurrent with the next batches' sampling
        self._gather_stream = "sample"
        # each worker's CUDA streams, kept across epochs: the caching allocator keeps freed memory per
        # stream, so new streams every epoch would make every epoch's first batches allocate afresh
        self._streams: dict[int, tuple[torch.cuda.Stream, ...]] = {}
        self.epoch = 0
        self.sample_device = (self.device if self.device.type == "cuda" and graph.placement in ("unified", "cuda")
                              else torch.device("cpu"))
        for name, t in (("features", features), ("labels", labels)):
            if t is not None and t.shape[0] != graph.num_nodes:
                raise LoaderError(f"{name} has {t.shape[0]} rows but the graph has {graph.num_nodes} nodes")
            if t is not None:
                placement_of(t)
        self.features = features
        self.labels = labels
        seeds = torch.as_tensor(seeds)
        if seeds.dim() != 1 or seeds.dtype not in (torch.int32, torch.int64):
            raise LoaderError("seeds must be a 1-D int32/int64 tensor of node ids")
        seeds = seeds.to("cpu", torch.int64)
        if seeds.numel():
            lo, hi = (int(v) for v in torch.aminmax(seeds))
            if lo < 0 or hi >= graph.num_nodes:
                raise LoaderError(f"seed ids range over [{lo}, {hi}] but the graph has {graph.num_nodes} nodes")
            if torch.unique(seeds).numel() != seeds.numel():
                raise LoaderError("seeds contain duplicates; pass each node once (torch.unique(seeds))")
        self.seeds = seeds

    def __len__(self) -> int:
        n = self.seeds.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch number ``epoch`` (its shuffle and random streams)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        self.epoch += 1
        order = self.seeds
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = self.seeds[torch.randperm(self.seeds.numel(), generator=gen)]
        batches = [order[i * self.batch_size:(i + 1) * self.batch_size] for i in range(len(self))]
        steps = [epoch * len(self) + i for i in range(len(batches))]
        if self.prefetch == 0:
            return (self._make(b, s) for b, s in zip(batches, steps))
        return _PrefetchIter(self, list(zip(batches, steps)))

    # -- one batch ---------------------------------------------------------------------------
    def _make(self, seeds_cpu: torch.Tensor, step: int) -> Batch:
        """Sample, gather and prepare one batch on the current stream and wait for it (no prefetching)."""
        batch = self._collect(self._start(seeds_cpu, step), None)
        self._prepare(batch, None)
        if batch._events:
            batch._events[-1].synchronize()
        return batch

    def _start(self, seeds_cpu: torch.Tensor, step: int) -> "_Started":
        """Queue the sampling of one batch on the current stream (nothing waits yet)."""
        sw = _Stopwatch()
        seeds = seeds_cpu.to(self.sample_device, non_blocking=True)
        pending = self.sampler._launch(self.graph, seeds, step)
        return _Started(seeds, step, pending, sw.wall(), sw.cpu(), sw.wait())

    def _collect(self, st: "_Started", gather_stream: torch.cuda.Stream | None) -> Batch:
        """Wait for ``st``'s sample, then gather its features and labels.

        With ``gather_stream`` (the prefetching threads on the GPU path) the gather runs there and
        is not waited for, so that its PCIe reads overlap the ``prepare`` hook and the next batch's
        sampling; the batch carries the events the consumer's stream waits on.  Called on the
        sampling stream.
        """
        sw = _Stopwatch()
        blocks = st.pending.blocks()
        seeds = st.seeds
        t1 = time.perf_counter()
        events: list[torch.cuda.Event] = []
        check = None
        if gather_stream is not None and self.sample_device.type == "cuda":
            gather_stream.wait_event(st.pending.event)
            with torch.cuda.stream(gather_stream):
                # the sampled ids are < num_nodes = the tables' rows, so the kernels' bounds check is read
                # later (`_GatherCheck`), not waited for here
                flag = _ut().ErrorFlag()
                src = blocks[0].src_nodes
                x = gather_rows(self.features, src, flag) if self.features is not None else None
                y = gather_rows(self.labels, seeds, flag) if self.labels is not None else None
                src.record_stream(gather_stream)
                seeds.record_stream(gather_stream)
                events.append(torch.cuda.Event(blocking=True))
                events[-1].record(gather_stream)
                check = _GatherCheck(events[-1], flag, st.step)
        else:
            x = gather_rows(self.features, blocks[0].src_nodes) if self.features is not None else None
            y = gather_rows(self.labels, seeds) if self.labels is not None else None
            if self.device != self.sample_device:
                blocks = [b.to(self.device, non_blocking=False) for b in blocks]
                seeds = seeds.to(self.device)
            x = x.to(self.device) if x is not None else None
            y = y.to(self.device) if y is not None else None
        if self.device.type == "cuda":  # everything the sampling stream did for this batch
            events.append(torch.cuda.Event(blocking=True))
            events[-1].record()
        batch = Batch(blocks, x, y, seeds, st.sample_s + t1 - sw.t0)
        batch._events, batch._check = events, check
        # what the prepare stream waits for: the sampling (not the gather, when it shares the stream)
        batch._sampled = st.pending.event if st.pending.event is not None else (events[-1] if events else None)
        batch.gather_s = time.perf_counter() - t1
        batch.producer_cpu_s = st.cpu_s + sw.cpu()
        batch.producer_gpu_wait_s = st.wait_s + sw.wait()
        return batch

    def _prepare(self, batch: Batch, prepare_stream: torch.cuda.Stream | None) -> None:
        """Run the ``prepare`` hook (on ``prepare_stream``, after the batch's sampling stream work, if given)."""
        if self.prepare is None:
            return
        sw = _Stopwatch()
        if prepare_stream is not None:
            # no record_stream(prepare_stream) on the batch's tensors: the consumer's stream waits for this
            # stream's event before it uses them, and they are record_stream-ed there, so they outlive the
            # reads here (a batch dropped unhanded only has its own kernels read freed memory)
            prepare_stream.wait_event(batch._sampled)
            with torch.cuda.stream(prepare_stream):
                batch._prepared = list(self.prepare(batch) or ())
                event = torch.cuda.Event(blocking=True)
                event.record()
        else:
            batch._prepared = list(self.prepare(batch) or ())
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event(blocking=True)
                event.record()
        if event is not None:
            batch._events.append(event)
        sw.charge(batch, "gather")


class _Stopwatch:
    """Wall time, this thread's CPU time and its sleep in host syncs since construction (seconds)."""

    def __init__(self) -> None:
        self.t0, self.c0, self.w0 = time.perf_counter(), time.thread_time(), gpu_wait_seconds()

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def cpu(self) -> float:
        return time.thread_time() - self.c0

    def wait(self) -> float:
        return gpu_wait_seconds() - self.w0

    def charge(self, batch: Batch, stage: str) -> None:
        """Add the elapsed times to ``batch``: wall to ``batch.<stage>_s``, CPU and sleep to the producer's."""
        setattr(batch, f"{stage}_s", getattr(batch, f"{stage}_s") + self.wall())
        batch.producer_cpu_s += self.cpu()
        batch.producer_gpu_wait_s += self.wait()


@dataclass
class _Started:
    """A batch whose sampling is queued (`NeighborLoader._start`)."""

    seeds: torch.Tensor
    step: int
    pending: Any
    sample_s: float
    cpu_s: float
    wait_s: float


@dataclass
class _GatherCheck:
    """A batch's deferred bounds check: its gather's event and the flag the kernels write to."""

    event: torch.cuda.Event
    flag: Any
    step: int

    def done(self) -> bool:
        return self.event.query()

    def raise_if_bad(self) -> None:
        """Wait for the gather (without the GIL) and raise `LoaderError` if it saw a bad index."""
        self.event.synchronize()
        try:
            self.flag.raise_if_set()
        except IndexError as exc:
            raise LoaderError(f"batch {self.step}: the feature/label gather read an out-of-range node id "
                              f"({exc}); the graph's indices do not match the tables' rows") from exc


class _PrefetchIter:
    """Prepares batches in background threads (each on its own CUDA stream) while the consumer trains.

    Batch ``k`` is made by worker ``k % num_workers`` and read from that worker's queue, so the
    batches arrive in order whatever the number of workers.
    """

    _DONE = object()

    def __init__(self, loader: NeighborLoader, work: list[tuple[torch.Tensor, int]]) -> None:
        self._loader = loader
        self._n = len(work)
        self._next = 0
        self._stop = threading.Event()
        self._cuda = loader.device.type == "cuda"
        self.queue_wait_s = 0.0  # producers' time blocked on a full queue (waiting for the consumer)
        k = max(1, min(loader.num_workers, len(work)))
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=loader.prefetch) for _ in range(k)]
        self._threads = [
            threading.Thread(target=self._run, args=(i, work[i::k]), daemon=True,
                             name=f"datapath-neighbor-loader-{i}")
            for i in range(k)
        ]
        for t in self._threads:
            t.start()

    def _put(self, q: queue.Queue, item: object) -> bool:
        t0 = time.perf_counter()
        try:
            while not self._stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False
        finally:
            self.queue_wait_s += time.perf_counter() - t0  # float += under the GIL: fine for a statistic

    def _streams(self, i: int) -> tuple[torch.cuda.Stream, ...]:
        """Worker ``i``'s (sampling, gather, prepare) streams, made once per loader."""
        loader = self._loader
        streams = loader._streams.get(i)
        if streams is None:
            dev, prio = loader.device, loader.stream_priority
            # the gather stream has the lowest priority: bulk PCIe reads
            streams = (torch.cuda.Stream(dev, priority=prio), torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=prio))
            loader._streams[i] = streams
        return streams

    def _run(self, i: int, work: list[tuple[torch.Tensor, int]]) -> None:
        q = self._queues[i]
        try:
            if self._cuda:
                torch.cuda.set_device(self._loader.device)
                if self._loader._overlap_gather:
                    self._run_pipelined(q, work, self._streams(i))
                    return
                stream = self._streams(i)[0]
            for seeds, step in work:
                if self._stop.is_set():
                    return
                if self._cuda:
                    with torch.cuda.stream(stream):
                        batch = self._loader._make(seeds, step)
                else:
                    batch = self._loader._make(seeds, step)
                if not self._put(q, batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(q, exc)
            return
        self._put(q, self._DONE)

    def _run_pipelined(self, q: queue.Queue, work: list[tuple[torch.Tensor, int]],
                       streams: tuple[torch.cuda.Stream, ...]) -> None:
        """The GPU producer: three streams, and the sampling of later batches queued before ``prepare``.

        The sampling stream samples; the gather stream reads features and labels over PCIe; the
        prepare stream runs the ``prepare`` hook.  The sampling of batch k + `SAMPLE_AHEAD` is queued
        before batch k's ``prepare`` runs on the CPU, so the one wait for a batch's sizes
        (`PendingSample.blocks`) mostly finds its kernels done instead of sleeping while they read
        the graph over PCIe.  An error of a later batch reaches the consumer after the batches
        before it.
        """
        loader = self._loader
        sample_stream, gather_stream, prepare_stream = streams
        if loader._gather_stream == "sample":
            gather_stream = sample_stream
        checks: list[_GatherCheck] = []
        pending: collections.deque = collections.deque()

        def launch(j: int) -> "_Started | BaseException":
            with torch.cuda.stream(sample_stream):
                try:
                    return loader._start(*work[j])
                except Exception as exc:  # noqa: BLE001 - raised when its turn comes
                    return exc

        for j in range(min(SAMPLE_AHEAD, len(work))):
            pending.append(launch(j))
        for k in range(len(work)):
            if self._stop.is_set():
                return
            while checks and checks[0].done():
                checks.pop(0).raise_if_bad()
            st = pending.popleft()
            if isinstance(st, BaseException):
                raise st
            with torch.cuda.stream(sample_stream):
                batch = loader._collect(st, gather_stream)
            j = k + SAMPLE_AHEAD
            if j < len(work) and not any(isinstance(p, BaseException) for p in pending):
                sw = _Stopwatch()
                nxt = launch(j)
                sw.charge(batch, "sample")  # batch j's sampling launch ran here: counted in this batch's times
                if isinstance(nxt, _Started):
                    nxt.sample_s = nxt.cpu_s = nxt.wait_s = 0.0
                pending.append(nxt)
            loader._prepare(batch, prepare_stream)
            if batch._check is not None:
                checks.append(batch._check)
            if not self._put(q, batch):
                return
        for c in checks:
            c.raise_if_bad()
        self._put(q, self._DONE)

    def __iter__(self) -> "_PrefetchIter":
        return self

    def __next__(self) -> Batch:
        if self._stop.is_set() or self._next >= self._n:
            self.close()
            raise StopIteration
        item = self._queues[self._next % len(self._queues)].get()
        self._next += 1
        if item is self._DONE:  # a worker ended early (stopped): nothing more comes in order
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch: Batch = item
        if self._cuda:
            cur = torch.cuda.current_stream(self._loader.device)
            for event in batch._events:
                cur.wait_event(event)
            for t in batch.tensors():
                if t.device.type == "cuda":
                    t.record_stream(cur)
        return batch

    def close(self) -> None:
        """Stop the producer threads (called at the end, on errors, and when the iterator is dropped)."""
        self._stop.set()
        for q in self._queues:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for t in self._threads:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=10)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
