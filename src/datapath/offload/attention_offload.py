"""Recomputing a block with its attention outputs offloaded: saved in the forward, moved to the store, fetched back.

`datapath.offload.attention_saved` keeps a recomputed block's attention outputs on the
device from its forward to its backward.  At the longest sequences a GPU trains, the
device has no room for them (the block inputs that checkpointing holds fill it), but the
host does: a block recomputed with ``attention_offloaded`` saves the outputs of its
scaled-dot-product-attention ops in the forward (not a call with dropout: it runs again,
see `datapath.offload.attention_saved.draws_random`), copies the large ones (over
`OFFLOAD_MIN_BYTES`) into the offload store on the store stream, and lets the device
copies go as soon as the forward is done with them.  In the backward, the block's
recomputation gets the outputs back from the store instead of running the attention
forward again; when a block's recomputation starts, the previous block's (the next one
the backward recomputes) are fetched on the load stream, so one block's outputs are in
flight beside the one being recomputed.  The fetched bytes are the forward's own, so the
gradients are bit-identical to plain recomputation.

The outputs go in chunks of at most `CHUNK_BYTES` (the host pool's slab size: they reuse
the slabs the store already pinned), each a slot of the cache's store, so they share its
room with the saved tensors the plan offloads (the planner counts both).  A chunk the
store has no room for, or whose write fails, stays on the device (nothing is lost; the
step holds more memory than planned).

Use: `AttentionStore.contexts` is the ``context_fn`` of
`torch.utils.checkpoint.checkpoint`; `datapath.offload.recompute.set_recompute` puts it on
the blocks a `memory_budget` plan names.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from datapath.offload.attention_saved import SDPA_OPS, draws_random
from datapath.offload.errors import OffloadError
from datapath.offload.store import IOResult, Slot, Store, Streams
from datapath.offload.views import ViewSpec, rebuild, storage_bytes

OFFLOAD_MIN_BYTES = 64 << 10
"""An attention output smaller than this (the log-sum-exp at short lengths, RNG seeds) stays on the device."""

CHUNK_BYTES = 256 << 20
"""The largest piece of an output one store slot holds (the host pool's default slab size)."""

_RERUN = object()  # an attention call with dropout: not saved, run again in the recomputation


@dataclasses.dataclass(eq=False)  # compared by identity (they hold tensors)
class _Chunk:
    slot: Slot
    start: int                      # byte offset in the storage
    nbytes: int
    written: IOResult               # the store's write: its event ends the copy
    read: IOResult | None = None    # the store's read, once queued: its cleanup frees the slot
    freed: bool = False

    def release(self) -> None:
        """Give the slot's room back once its copies ended (waiting for them)."""
        if self.freed:
            return
        self.freed = True
        for res in (self.written, self.read):
            if res is not None and res.event is not None:
                res.event.synchronize()
        if self.read is None:
            self.slot.store.free(self.slot)
        elif self.read.cleanup is not None:
            self.read.cleanup()


@dataclasses.dataclass(eq=False)
class _Offloaded:
    """One output tensor moved to the store: its view over its storage and the storage's chunks; the device bytes
    until every write ended (``source``); once loaded, the device bytes being read into (``fetched``)."""

    spec: ViewSpec
    device: torch.device
    nbytes: int
    chunks: list[_Chunk]
    source: torch.Tensor | None
    fetched: torch.Tensor | None = None


def _done(res: IOResult | None) -> bool:
    return res is None or res.event is None or bool(res.event.query())


def _release(leaves: list[_Offloaded]) -> None:
    """Free the store room of ``leaves`` (waiting for copies still running)."""
    for leaf in leaves:
        for c in leaf.chunks:
            c.release()
        leaf.source = None


class _Frame:
    """The attention outputs of one forward of one block, in the order its ops ran, until its recomputation."""

    def __init__(self, owner: "AttentionStore", prev: "_Frame | None") -> None:
        self.owner = owner
        self.prev = weakref.ref(prev) if prev is not None else None
        self.saved: dict[Any, list[Any]] = {}
        self.leaves: list[_Offloaded] = []
        self.taken = 0
        self.count = 0
        # a frame whose backward never runs (an exception, a graph let go) gives its room back once collected: its
        # outputs are handed to the owner (a list append: the collector may run anywhere, a lock held included)
        # and released at the owner's next save or fetch (`AttentionStore._drain`)
        weakref.finalize(self, owner._orphans.append, self.leaves)

    @property
    def pending(self) -> bool:
        """Some output of the frame waits for its recomputation."""
        return self.taken < self.count

    def prefetch(self) -> None:
        """Start the load of every offloaded output not loaded yet."""
        for leaf in self.leaves:
            if leaf.fetched is None and leaf.chunks and leaf.chunks[0].read is None:
                self.owner._load(leaf, prefetch=True)

    def take(self, func: Any) -> Any:
        outs = self.saved.get(func)
        if not outs:
            raise OffloadError(f"{func} ran in a recomputation but not in its block's forward (or ran more often): "
                               f"the block's forward is not deterministic; recompute it without its attention "
                               f"offloaded")
        out = outs.pop(0)
        self.taken += 1
        self.owner._drain()
        if out is _RERUN:
            return out
        return tree_map(lambda x: self.owner._device_copy(x) if isinstance(x, _Offloaded) else x, out)


class _Saving(TorchDispatchMode):
    """A block's forward: every op runs; the attention ops' outputs are put in the frame (the large ones
    offloaded)."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__()
        self.frame = frame

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SDPA_OPS:
            owner = self.frame.owner
            owner._drain()
            # a call with dropout runs again in the recomputation (`draws_random`)
            kept = _RERUN if draws_random(func, args, kwargs) else tree_map(lambda x: owner._save(self.frame, x), out)
            self.frame.saved.setdefault(func, []).append(kept)
            self.frame.count += 1
        return out


class _Fetching(TorchDispatchMode):
    """A block's recomputation: the attention ops return the forward's outputs (fetched from the store); every
    other op runs again.  Entering it starts fetching the block the backward recomputes next."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__()
        self.frame = frame

    def __enter__(self) -> "_Fetching":
        prev = self.frame.prev() if self.frame.prev is not None else None
        if prev is not None and prev.pending:
            prev.prefetch()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in SDPA_OPS:
            out = self.frame.take(func)
            if out is not _RERUN:
                return out
        return func(*args, **(kwargs or {}))


class AttentionStore:
    """Where blocks recomputed with ``attention_offloaded`` keep their attention outputs: ``store`` (a host store:
    the cache's, or its tiered store's host tier), copies on the streams ``streams_for(device)`` gives.

    ``stored_bytes`` / ``fetched_bytes`` / ``prefetched_bytes`` / ``kept_bytes`` (outputs left on the device: no
    room, a write failed) count since construction."""

    def __init__(self, store: Store, streams_for: Callable[[torch.device], Streams],
                 chunk_bytes: int = CHUNK_BYTES, min_bytes: int = OFFLOAD_MIN_BYTES) -> None:
        self.store = store
        self.streams_for = streams_for
        self.chunk_bytes = int(chunk_bytes)
        self.min_bytes = int(min_bytes)
        self.stored_bytes = 0
        self.fetched_bytes = 0
        self.prefetched_bytes = 0
        self.kept_bytes = 0
        self._last: weakref.ref[_Frame] | None = None
        self._writing: list[_Offloaded] = []
        self._reading: list[_Chunk] = []
        self._orphans: list[list[_Offloaded]] = []   # outputs of frames collected before their recomputation
        self._lock = threading.Lock()

    def room(self) -> int:
        """Bytes the store may still take now."""
        r = self.store.room()
        return int(r) if r is not None else 0

    def capacity(self) -> int:
        """The store's whole budget (its room when it has no fixed one)."""
        budget = getattr(self.store, "budget", None)
        return int(budget) if budget is not None else self.room()

    def contexts(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """``context_fn`` for `torch.utils.checkpoint.checkpoint`: (the forward's mode, the recomputation's)."""
        prev = self._last() if self._last is not None else None
        frame = _Frame(self, prev if prev is not None and prev.pending else None)
        self._last = weakref.ref(frame)
        return _Saving(frame), _Fetching(frame)

    def close(self) -> None:
        """Give back the room of every output already fetched or let go of (waiting for their copies); outputs of
        a graph still held keep theirs until it is backpropagated or freed."""
        self._drain()
        with self._lock:
            reading, self._reading = self._reading, []
        for c in reading:
            c.release()

    # -- the forward: saving
    def _save(self, frame: _Frame, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if type(x) is not torch.Tensor or x.layout != torch.strided or x.device.type not in ("cuda", "cpu"):
            return x.detach()
        nbytes = x.untyped_storage().nbytes()
        if nbytes < self.min_bytes:
            return x.detach()
        streams = self.streams_for(x.device) if x.is_cuda else None
        src = storage_bytes(x)
        ready = None
        if x.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
        leaf = _Offloaded(ViewSpec.of(x), x.device, nbytes, [], src)
        try:
            for start in range(0, nbytes, self.chunk_bytes):
                n = min(self.chunk_bytes, nbytes - start)
                slot = self.store.reserve(n)
                if slot is None:
                    raise _NoRoom
                try:
                    res = slot.store.write(slot, src[start: start + n], ready, streams, "attention", lambda: False)
                except BaseException:
                    slot.store.unreserve(slot)
                    raise
                slot.loc, slot.crc = res.loc, res.crc
                leaf.chunks.append(_Chunk(slot, start, n, res))
        except (_NoRoom, OSError):  # no room, or the store failed: the output stays on the device
            _release([leaf])
            self.kept_bytes += nbytes
            return x.detach()
        frame.leaves.append(leaf)
        self.stored_bytes += nbytes
        with self._lock:
            self._writing.append(leaf)
        return leaf

    def _drain(self) -> None:
        """Let go of the device bytes of outputs whose writes ended, of the host room of reads that ended, and of
        everything collected frames held (waiting for their copies)."""
        while self._orphans:
            _release(self._orphans.pop())
        with self._lock:
            writing, self._writing = self._writing, []
            reading, self._reading = self._reading, []
        still = []
        for leaf in writing:
            if all(_done(c.written) for c in leaf.chunks):
                leaf.source = None
            else:
                still.append(leaf)
        waiting = []
        for c in reading:
            if _done(c.read):
                c.release()
            else:
                waiting.append(c)
        with self._lock:
            self._writing.extend(still)
            self._reading.extend(waiting)

    # -- the backward: fetching
    def _load(self, leaf: _Offloaded, prefetch: bool) -> None:
        """Allocate the device bytes of ``leaf`` (on the current stream) and queue their reads (on the load stream,
        after the writes and the allocation)."""
        dev = leaf.device
        dst = torch.empty(leaf.nbytes, dtype=torch.uint8, device=dev)
        streams = self.streams_for(dev) if dev.type == "cuda" else None
        alloc = None
        if streams is not None:
            alloc = torch.cuda.Event()
            alloc.record(torch.cuda.current_stream(dev))
            for c in leaf.chunks:
                if c.written.event is not None:
                    streams.load.wait_event(c.written.event)
        for c in leaf.chunks:
            c.read = c.slot.store.read(c.slot, dst[c.start: c.start + c.nbytes], alloc, streams, "attention")
        leaf.fetched = dst
        self.fetched_bytes += leaf.nbytes
        if prefetch:
            self.prefetched_bytes += leaf.nbytes

    def _device_copy(self, leaf: _Offloaded) -> torch.Tensor:
        """The output ``leaf`` stands for, on its device, ready on the current stream."""
        if leaf.fetched is None:
            self._load(leaf, prefetch=False)
        assert leaf.fetched is not None
        data, leaf.fetched = leaf.fetched, None
        if data.is_cuda:
            cur = torch.cuda.current_stream(data.device)
            for c in leaf.chunks:
                if c.read is not None and c.read.event is not None:
                    cur.wait_event(c.read.event)
        with self._lock:  # their host room goes back once each read ended (`_drain`)
            self._reading.extend(leaf.chunks)
        leaf.source = None
        return rebuild(data, leaf.spec)


class _NoRoom(Exception):
    pass
