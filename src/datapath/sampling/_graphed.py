"""`NeighborSampler`'s GPU hops captured once as a CUDA graph and replayed for every batch.

A sample's GPU work is a fixed sequence of about 25 launches a hop (the sampling kernel,
the sort-based relabelling, the block's CSR) on arrays whose sizes depend only on the
seeds' capacity and the fanouts: the sizes of the real sample stay on the device (rows
past them are padding the kernels skip).  Launched one by one from Python each batch, they
cost the loader's thread several milliseconds of CPU a batch, which is what a small batch's
step is made of.  Captured once per (graph, capacity), a batch is one replay:
the seeds are copied into the graph's input buffer, the count of seeds and each hop's random
key into its meta buffer (the kernel reads its key from there), and the outputs are copied
out of the graph's buffers in one copy (the next replay overwrites them while the blocks of
this one may still be in use).  The blocks are bit-identical to the launches' one by one.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("datapath.sampling")

Queue = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, list]]
"""``queue(dst, capacity, n_dev, keys)``: the hops' launches for seeds ``dst`` ((capacity,) int64, the first
``n_dev[0]`` valid) with each hop's key read from ``keys`` ((hops,) int64 on the device); returns ``(sizes,
pending)`` as `datapath.sampling.neighbor_sampler.PendingSample` takes them."""

MAX_GRAPHS = 8
"""Captured graphs kept per sampler (the least recently used go first): each holds its own memory."""


class GraphedSample:
    """The hops of one sampler for up to ``capacity`` seeds on ``device``, captured as one CUDA graph.

    `run` replays it on the current stream for ``seeds`` ((B,) int64, B <= capacity, on ``device``) and ``keys``
    (one 64-bit key per hop) and returns ``(sizes, pending)`` in tensors of their own (a copy of the graph's).
    """

    def __init__(self, queue: Queue, hops: int, capacity: int, device: torch.device) -> None:
        self.capacity = int(capacity)
        self.hops = int(hops)
        self._seeds = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self._meta = torch.zeros(1 + self.hops, dtype=torch.int64, device=device)  # [count, key of each hop]
        self._meta[0] = self.capacity
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up launches outside the capture (workspaces, lazy inits)
            queue(self._seeds, self.capacity, self._meta[:1], self._meta[1:])
        torch.cuda.current_stream(device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            sizes, pending = queue(self._seeds, self.capacity, self._meta[:1], self._meta[1:])
            parts = [sizes] + [t for hop in pending for t in hop[:4] if t is not None]
            self._out = torch.cat([t.reshape(-1) for t in parts])
        # where each output lies in the flat copy (static: every replay has the same shapes)
        self._layout: list[list[tuple[int, int] | None]] = []
        self._fanouts = [hop[4] for hop in pending]
        offset = sizes.numel()
        self._sizes_len = sizes.numel()
        for hop in pending:
            spans: list[tuple[int, int] | None] = []
            for t in hop[:4]:
                if t is None:
                    spans.append(None)
                else:
                    spans.append((offset, t.numel()))
                    offset += t.numel()
            self._layout.append(spans)

    def run(self, seeds: torch.Tensor, keys: list[int]) -> tuple[torch.Tensor, list]:
        """Replay for ``seeds`` with these hop ``keys``; the outputs are this call's own tensors."""
        b = seeds.numel()
        meta = torch.tensor([b] + [k - (1 << 64) if k >= 1 << 63 else k for k in keys], dtype=torch.int64)
        self._meta.copy_(meta, non_blocking=True)  # from pageable memory: staged before the call returns
        self._seeds[:b].copy_(seeds)
        self._graph.replay()
        flat = self._out.clone()
        pending = []
        for spans, fanout in zip(self._layout, self._fanouts):
            ts = [None if s is None else flat.narrow(0, s[0], s[1]) for s in spans]
            pending.append((*ts, fanout))
        return flat[: self._sizes_len], pending


_CAPTURE = threading.Lock()
"""One capture at a time in the process, and graphs are let go under it too: torch registers every captured graph
with the device's random generator, whose bookkeeping is not safe against concurrent captures and releases."""


class _Entry:
    """A captured graph, the lock its replays' enqueues take, and the stream and event of its last replay."""

    def __init__(self, graph: Any, sample: GraphedSample) -> None:
        self.ref = weakref.ref(graph)
        self.sample = sample
        self.lock = threading.Lock()
        self.stream: torch.cuda.Stream | None = None
        self.done: torch.cuda.Event | None = None


class GraphCache:
    """A sampler's captured graphs, by (graph, capacity, device, the sampler's settings that shape the launches).

    Capturing is a step of its own (`capture`), taken where nothing else in the process draws from the GPU's
    random generator: while torch captures a graph it marks the device's generator as capturing, and a dropout
    drawn meanwhile on another thread fails ("Offset increment outside graph capture").  The loader captures as
    an epoch begins, in the thread that iterates it; its producer threads only replay.  A replay may run on any
    stream: one on another stream than the last waits for it (the graph's input and output buffers are shared).
    A graph object that died is never matched by another that reuses its id.
    """

    def __init__(self) -> None:
        self._graphs: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.failed = False

    def _find(self, graph: Any, batch: int, device: torch.device, config: tuple[Any, ...]) -> _Entry | None:
        """A graph for ``batch`` seeds: one captured for at most twice as many (the loader's last, smaller batch)."""
        with self._lock:
            for key, e in reversed(self._graphs.items()):
                if key[0] == id(graph) and key[2:] == (device.index, config) and e.ref() is graph \
                        and batch <= e.sample.capacity <= 2 * batch:
                    self._graphs.move_to_end(key)
                    return e
        return None

    def capture(self, graph: Any, batch: int, device: torch.device, hops: int, queue: Queue,
                config: tuple[Any, ...]) -> bool:
        """Capture a graph for ``batch`` seeds unless one fits; False once a capture has failed.  ``config``: the
        sampler's settings the launches depend on (a graph captured under others is not replayed)."""
        if self.failed:
            return False
        if batch < 1 or self._find(graph, batch, device, config) is not None:
            return True
        with _CAPTURE:
            try:
                g = GraphedSample(queue, hops, batch, device)
            except Exception as exc:  # noqa: BLE001 - a capture fails in many ways; the launches remain
                self.failed = True
                log.warning("sampling: capturing the GPU sampling as a CUDA graph failed (%s: %s); sampling "
                            "launches its kernels one by one from now on", type(exc).__name__, exc)
                return False
            with self._lock:
                self._graphs[(id(graph), batch, device.index, config)] = _Entry(graph, g)
                while len(self._graphs) > MAX_GRAPHS:
                    self._graphs.popitem(last=False)  # released under the capture lock
        return True

    def run(self, graph: Any, seeds: torch.Tensor, keys: list[int], config: tuple[Any, ...]
            ) -> tuple[torch.Tensor, list] | None:
        """Replay a captured graph for ``seeds`` on the current stream; None where none was captured for them."""
        e = self._find(graph, seeds.numel(), seeds.device, config)
        if e is None:
            return None
        stream = torch.cuda.current_stream(seeds.device)
        with e.lock:
            if e.done is not None and e.stream != stream:
                stream.wait_event(e.done)
            out = e.sample.run(seeds, keys)
            e.stream, e.done = stream, torch.cuda.Event()
            e.done.record(stream)
        return out
