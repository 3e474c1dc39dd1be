"""One offloaded storage (`Entry`) and what autograd holds in its place (`Handle`).

An entry moves through these states::

    PENDING --store starts--> STORING --store done--> STORED --load starts--> LOADING --> RESIDENT
       |                         |                                                        ^
       +--needed first (cancel)--+--needed first (forward from memory)--------------------+
    any store or load error --> RESIDENT (on_error="keep", stores only) or FAILED (raised in the step)
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

import torch

from datapath.offload.store import Slot, Store
from datapath.offload.views import ViewSpec

PENDING, STORING, STORED, LOADING, RESIDENT, FAILED = "pending", "storing", "stored", "loading", "resident", "failed"


class Entry:
    """One offloaded storage and where its bytes are."""

    __slots__ = ("sid", "nbytes", "device", "record", "segment", "slot", "state", "src", "tensor", "version",
                 "pack_event", "pack_stream", "gpu", "ready", "ready_event", "alloc_stream", "handles",
                 "released", "forwarded", "cancelled", "modified", "error", "name", "counted", "ahead",
                 "hold", "__weakref__")

    def __init__(self, sid: int, nbytes: int, device: torch.device, record: Any, segment: int,
                 slot: Slot, src: torch.Tensor, tensor: torch.Tensor) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.device = device
        self.record = record                       # the `records.Record` it was saved in (times are added to it)
        self.segment = segment
        self.slot = slot                           # room in the store (slot.store: the tier that holds it)
        self.state = PENDING
        self.src: torch.Tensor | None = src        # uint8 alias of the storage, held until stored
        self.tensor: torch.Tensor | None = tensor  # the packed tensor (its version counter), held until stored
        self.version = tensor._version
        self.pack_event: Any = None
        self.pack_stream: Any = None
        self.gpu: torch.Tensor | None = None       # the bytes in device memory (forwarded or reloaded) ...
        self.hold: weakref.ref[Hold] | None = None  # ... or, once handed to autograd, in its handles' `Hold`
        self.ready = threading.Event()
        self.ready_event: Any = None
        self.alloc_stream: Any = None
        self.handles = 0
        self.released = False
        self.forwarded = False
        self.cancelled = False
        self.modified = False
        self.error: BaseException | None = None
        self.name = f"{sid}.act"
        self.counted = True  # its bytes count as in flight until its store ends
        self.ahead = False   # loaded by a prefetch and not yet handed to autograd

    @property
    def store(self) -> Store:
        return self.slot.store

    def data(self) -> torch.Tensor | None:
        """The bytes in device memory: the entry's own, or those handed over to its handles (`hand_over`)."""
        if self.gpu is not None:
            return self.gpu
        hold = self.hold() if self.hold is not None else None
        return None if hold is None else hold.data

    def hand_over(self) -> None:
        """Give the bytes in device memory to the entry's handles (a resident entry being unpacked).

        From then on only the handles autograd holds keep them: when the last handle dies they go back to
        the allocator at once, in C (a `Hold` runs no Python code when it dies), not at the next drain of
        `Releases` (which may come only after the next block's loads were allocated: one more block's
        activations at the step's peak).
        """
        if self.gpu is None or self.state != RESIDENT or self.hold is None:
            return
        hold = self.hold()
        if hold is not None:
            hold.data, self.gpu = self.gpu, None


class Hold:
    """The bytes of an entry in device memory once autograd has them: held by the entry's handles only."""

    __slots__ = ("data", "__weakref__")

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None


class _HandleRef(weakref.ref):
    """A weak reference to a `Handle` that remembers its entry (the handle is gone when it is read)."""

    __slots__ = ("entry",)


class Releases:
    """Handles autograd let go of, released in the main flow.

    A dying handle runs no Python code: its weak reference's callback is a C-level ``deque.append`` that
    queues it, and `drain` -- called by the hooks, at a root forward, at the end of a backward and when the
    cache closes -- releases its entry through ``drop``.  A Ctrl-C can then never land inside a finalizer,
    where Python prints "Exception ignored" and the interrupt is lost.  Once the cache is closed no main flow
    is left to drain: `release_at_death` makes the remaining handles release their entries as they die.
    The device memory of an unpacked entry does not wait for a drain: its handles hold it (`Entry.hand_over`).
    """

    __slots__ = ("drop", "_dead", "_refs")

    def __init__(self, drop: Callable[[Entry], None]) -> None:
        self.drop = drop
        self._dead: collections.deque[_HandleRef] = collections.deque()
        self._refs: set[_HandleRef] = set()  # keeps each reference alive until its handle dies

    def track(self, handle: "Handle") -> None:
        ref = _HandleRef(handle, self._dead.append)
        ref.entry = handle.entry
        self._refs.add(ref)

    def drain(self) -> None:
        """Release the entries of the handles that died since the last call (main flow only)."""
        dead = self._dead
        while dead:
            try:
                ref = dead.popleft()
            except IndexError:  # another thread drained it
                return
            self._release(ref)

    def _release(self, ref: _HandleRef) -> None:
        if ref in self._refs:  # once per handle, whichever of drain and a finalizer comes first
            self._refs.discard(ref)
            self.drop(ref.entry)

    def release_at_death(self) -> None:
        """From now on each live handle releases its entry when it dies (the owner closed: nothing drains any
        more); the ones dead already are released now."""
        self.drain()
        for ref in list(self._refs):
            handle = ref()
            if handle is not None:
                weakref.finalize(handle, self._release, ref).atexit = False

    def __len__(self) -> int:
        """Handles that died and are not released yet."""
        return len(self._dead)


class Handle:
    """What autograd keeps instead of an offloaded tensor: the entry and the view to rebuild.

    It has no ``__del__``: `Releases` notices when it dies (see there), and the bytes autograd was given
    (`Entry.hand_over`) go with the entry's last handle."""

    __slots__ = ("entry", "hold", "spec", "tref", "version", "__weakref__")

    def __init__(self, releases: Releases, entry: Entry, t: torch.Tensor) -> None:
        self.entry = entry
        hold = entry.hold() if entry.hold is not None else None
        if hold is None:  # the entry's first handle (handles of one entry share its `Hold`)
            hold = Hold()
            entry.hold = weakref.ref(hold)
        self.hold = hold
        self.spec = ViewSpec.of(t)
        self.tref = weakref.ref(t)
        self.version = t._version
        entry.handles += 1
        releases.track(self)
