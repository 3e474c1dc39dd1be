"""`NeighborLoader`: mini-batches of sampled blocks with their input features and labels.

On a GPU, with the graph and features in unified memory, everything happens on the
GPU: the kernel samples from the pinned graph over PCIe, blocks are built on the GPU,
and the feature rows are gathered zero-copy (`datapath.memory.gather_rows`), or from the
tiers of a `datapath.features.FeatureStore` (GPU cache, pinned host memory, disk).  A
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

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

from datapath.features import FeatureStore
from datapath.features.pending_gather import PendingGather
from datapath.features.superbatch import Schedule
from datapath.graph import Graph
from datapath.loaders._batch_steps import BatchSteps, GatherStream, Started, Stopwatch, run_prepare
from datapath.loaders._prefetch import PrefetchIter
from datapath.loaders.batch import Batch, GatherCheck
from datapath.loaders.errors import LoaderError
from datapath.memory import gather_rows, placement_of
from datapath.sampling import NeighborSampler
from datapath.memory import ErrorFlag

log = logging.getLogger("datapath.loaders")

Table = torch.Tensor | FeatureStore


def fetch_rows(table: Table, ids: torch.Tensor, flag: ErrorFlag | None = None, schedule: Schedule | None = None,
               step: int | None = None) -> torch.Tensor:
    """``table[ids]``: from a `FeatureStore`'s tiers (its disk rows from ``schedule``'s superbatch of ``step``,
    if given), or by the memory layer's gather for a tensor."""
    if isinstance(table, FeatureStore):
        return table.gather(ids, flag, schedule=schedule, step=step)
    return gather_rows(table, ids, flag)


class NeighborLoader:
    """Iterates over ``seeds`` in batches, sampling blocks and loading features and labels.

    Args:
        graph: the `Graph` (cpu, unified or cuda memory; unified or cuda for GPU sampling).
        seeds: (S,) distinct node ids to train on (int64/int32, any device).
        sampler: a `NeighborSampler` (or a list of fanouts).
        batch_size: seeds per batch.
        shuffle: a new permutation each epoch (seeded by ``seed`` and the epoch number).
        drop_last: skip the last incomplete batch.
        features: (N, F) node features: a `datapath.features.FeatureStore` (GPU cache, pinned host
            memory, disk), or a tensor: unified (zero-copy GPU gather), cuda, or cpu (CPU gather then copy).
        labels: (N,) node labels, a tensor placed like ``features`` or a `FeatureStore`.
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
        gather_stream: where a GPU producer gathers features and labels: ``"sample"`` (queued on the
            sampling stream: PCIe used by one of them at a time; the default), ``"own"`` (a stream of its
            own, concurrent with the next batches' sampling) or ``"serial"`` (each batch sampled,
            gathered and waited for in turn: no pipelining, for A/B measurements).  Also an attribute.

    Sampling runs on the GPU when ``device`` is cuda and the graph is in unified or cuda
    memory; otherwise on the CPU.  Each ``iter(loader)`` is one epoch.
    """

    def __init__(self, graph: Graph, seeds: torch.Tensor, sampler: NeighborSampler | list[int],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *,
                 features: Table | None = None, labels: Table | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 num_workers: int = 1, prepare: Callable[[Batch], Iterable[torch.Tensor] | None] | None = None,
                 stream_priority: int = 0, gather_stream: GatherStream = "sample") -> None:
        if not isinstance(sampler, NeighborSampler):
            sampler = NeighborSampler(sampler, seed=seed)
        if batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 0:
            raise LoaderError(f"prefetch must be >= 0, got {prefetch}")
        if num_workers < 1:
            raise LoaderError(f"num_workers must be >= 1, got {num_workers}")
        if gather_stream not in ("sample", "own", "serial"):
            raise LoaderError(f"gather_stream must be 'sample', 'own' or 'serial', got {gather_stream!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LoaderError(f"NeighborLoader(device={str(device)!r}) needs a CUDA GPU and torch.cuda.is_available() "
                              f"is False here (torch {torch.__version__}); pass device='cpu' or leave device out")
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
        self.gather_stream: GatherStream = gather_stream
        # each worker's CUDA streams, kept across epochs: the caching allocator keeps freed memory per
        # stream, so new streams every epoch would make every epoch's first batches allocate afresh
        self._streams: dict[int, tuple[torch.cuda.Stream, ...]] = {}
        self._iterators: weakref.WeakSet[PrefetchIter] = weakref.WeakSet()  # live epochs, closed by `close`
        self.epoch = 0
        self.sample_device = (self.device if self.device.type == "cuda" and graph.placement in ("unified", "cuda")
                              else torch.device("cpu"))
        for name, t in (("features", features), ("labels", labels)):
            if t is not None and t.shape[0] != graph.num_nodes:
                raise LoaderError(f"{name} has {t.shape[0]} rows but the graph has {graph.num_nodes} nodes")
            if t is not None and not isinstance(t, FeatureStore):
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

    def close(self) -> None:
        """Stop and join the producer threads of every epoch still being iterated (idempotent)."""
        for it in list(self._iterators):
            it.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

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
        self._capture_graphs([b.numel() for b in batches])
        if self.prefetch == 0:
            return (self._make(b, s) for b, s in zip(batches, steps))
        return self._prefetched(list(zip(batches, steps)), self._schedule(batches, steps))

    def _capture_graphs(self, sizes: list[int]) -> None:
        """Capture the GPU sampler's graphs for this epoch's batch sizes, here in the thread that iterates (that
        trains), not in the producers: while torch captures a graph, a dropout drawn on another thread fails
        (`NeighborSampler.capture_cuda_graphs`)."""
        if self.sample_device.type == "cuda" and sizes:
            self.sampler.capture_cuda_graphs(self.graph, sizes, self.sample_device)

    def _prefetched(self, work: list[tuple[torch.Tensor, int]], schedule: Schedule | None = None) -> PrefetchIter:
        """One epoch of ``work`` ((seeds, step) pairs) made by background threads from this loader's steps."""
        features = self.features
        steps = BatchSteps(
            make=self._make, start=self._start, collect=self._collect, prepare=self._prepare,
            abort=features.abort if isinstance(features, FeatureStore) else None, device=self.device,
            workers=self.num_workers, depth=self.prefetch, gather_stream=self.gather_stream,
            exchange=self._defers_exchange(), stream_priority=self.stream_priority, streams=self._streams)
        it = PrefetchIter(steps, work, schedule)
        self._iterators.add(it)
        return it

    def _schedule(self, batches: list[torch.Tensor], steps: list[int]) -> Schedule | None:
        """The feature store's superbatches for this epoch (None unless ``features`` is a store that makes them):
        its planner samples each batch again (a pure function of the step) to learn its disk rows ahead."""
        if not isinstance(self.features, FeatureStore):
            return None

        def input_nodes(k: int) -> torch.Tensor:
            return self._start(batches[k], steps[k]).pending.blocks()[0].src_nodes

        return self.features.schedule(steps, input_nodes)

    # -- one batch ---------------------------------------------------------------------------
    def _make(self, seeds_cpu: torch.Tensor, step: int, schedule: Schedule | None = None,
              defer: bool = False) -> Batch:
        """Sample, gather and prepare one batch on the current stream and wait for it (no prefetching).

        ``defer``: the collective gather is left to finish, and ``prepare`` to run after it (the exchange stage)."""
        batch = self._collect(self._start(seeds_cpu, step), None, schedule, defer)
        if not defer:
            self._prepare(batch, None)
        if batch._events:
            batch._events[-1].synchronize()
        return batch

    def _start(self, seeds_cpu: torch.Tensor, step: int) -> "Started":
        """Queue the sampling of one batch on the current stream (nothing waits yet)."""
        sw = Stopwatch()
        seeds = seeds_cpu.to(self.sample_device, non_blocking=True)
        pending = self.sampler._launch(self.graph, seeds, step)
        return Started(seeds, step, pending, sw.wall(), sw.cpu(), sw.wait())

    def _defers_exchange(self) -> bool:
        """Whether the features come from a collective store whose exchanges a stage of their own can finish
        in order (the labels exchange nothing: their gathers would interleave with the stage's)."""
        return (isinstance(self.features, FeatureStore) and self.features.collective
                and self.features.device.type == self.device.type
                and not (isinstance(self.labels, FeatureStore) and self.labels.collective))

    def _features(self, ids: torch.Tensor, flag: ErrorFlag | None, schedule: Schedule | None, step: int,
                  defer: bool) -> tuple[torch.Tensor | None, PendingGather | None]:
        """The batch's features, and with ``defer`` the collective gather still to finish (`PendingGather`)."""
        if self.features is None:
            return None, None
        if defer:
            pending = self.features.start_gather(ids, flag, schedule=schedule, step=step, defer=True)
            return pending.out, pending
        return fetch_rows(self.features, ids, flag, schedule, step), None

    def _collect(self, st: "Started", gather_stream: torch.cuda.Stream | None,
                 schedule: Schedule | None = None, defer: bool = False) -> Batch:
        """Wait for ``st``'s sample, then gather its features and labels.

        ``defer`` (a collective feature store, `_defers_exchange`): the gather of the rows of other ranks is
        left to the caller (``batch._pending``), which finishes the batches' gathers in order.

        With ``gather_stream`` (the prefetching threads on the GPU path) the gather runs there and
        is not waited for, so that its PCIe reads overlap the ``prepare`` hook and the next batch's
        sampling; the batch carries the events the consumer's stream waits on.  Called on the
        sampling stream.
        """
        sw = Stopwatch()
        blocks = st.pending.blocks()
        seeds = st.seeds
        t1 = time.perf_counter()
        events: list[torch.cuda.Event] = []
        check = None
        if gather_stream is not None and self.sample_device.type == "cuda":
            gather_stream.wait_event(st.pending.event)
            with torch.cuda.stream(gather_stream):
                # the sampled ids are < num_nodes = the tables' rows, so the kernels' bounds check is read
                # later (`GatherCheck`), not waited for here
                flag = ErrorFlag()
                src = blocks[0].src_nodes
                x, pending = self._features(src, flag, schedule, st.step, defer)
                y = fetch_rows(self.labels, seeds, flag) if self.labels is not None else None
                src.record_stream(gather_stream)
                seeds.record_stream(gather_stream)
                events.append(torch.cuda.Event(blocking=True))
                events[-1].record(gather_stream)
                check = GatherCheck(events[-1], flag, st.step)
        else:
            x, pending = self._features(blocks[0].src_nodes, None, schedule, st.step, defer)
            y = fetch_rows(self.labels, seeds) if self.labels is not None else None
            if self.device != self.sample_device:
                blocks = [b.to(self.device, non_blocking=False) for b in blocks]
                seeds = seeds.to(self.device)
            if pending is None:  # (a deferred gather's rows are on the store's device, the loader's)
                x = x.to(self.device) if x is not None else None
            y = y.to(self.device) if y is not None else None
        if self.device.type == "cuda":  # everything the sampling stream did for this batch
            events.append(torch.cuda.Event(blocking=True))
            events[-1].record()
        batch = Batch(blocks, x, y, seeds, st.sample_s + t1 - sw.t0)
        batch._events, batch._check, batch._pending = events, check, pending
        # what the prepare stream waits for: the sampling (not the gather, when it shares the stream)
        batch._sampled = st.pending.event if st.pending.event is not None else (events[-1] if events else None)
        batch.gather_s = time.perf_counter() - t1
        batch.producer_cpu_s = st.cpu_s + sw.cpu()
        batch.producer_gpu_wait_s = st.wait_s + sw.wait()
        return batch

    def _prepare(self, batch: Batch, prepare_stream: torch.cuda.Stream | None) -> None:
        """Run the ``prepare`` hook (on ``prepare_stream``, after the batch's sampling stream work, if given)."""
        run_prepare(self.prepare, batch, prepare_stream, self.device)


