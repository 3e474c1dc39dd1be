"""The store interface: where the bytes of an offloaded storage go and come back from.

One interface, three implementations with the same methods:

- `HostStore` (``"host"``): a pool of pinned host memory;
- `FileStore` (``"ssd"``): one file per storage in a private directory (kvikio or POSIX);
- `TieredStore` (``"tiered"``): host memory up to its budget, then files.

A store moves the bytes of one storage (a 1-D ``uint8`` tensor on the GPU, or on
the CPU when CPU tensors are offloaded).  `Store.reserve` promises room and returns
a `Slot`; `Store.write` fills it, `Store.read` copies it back into device memory,
`Store.free` gives the room back.  On CUDA the copies run on the cache's own
store/load streams (`Streams`): a write first waits for the event recorded when the
tensor was packed (it reads finished data), a read first waits for the event
recorded when its destination was allocated (it never writes memory a kernel
still uses), and each returns the event that ends it.  Without CUDA every copy is
a plain synchronous copy in the worker thread.
"""
from __future__ import annotations

import abc
import itertools
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


_probe_ids = itertools.count()


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a 1-D ``uint8`` CPU tensor."""
    return zlib.crc32(memoryview(t.numpy()))


@dataclass(eq=False)
class Slot:
    """Room promised by a store for ``nbytes``; ``loc`` says where the bytes are once written."""

    store: "Store"                              # the store (for tiered: the tier) that holds the room
    nbytes: int
    loc: Any = None                             # a host block, or a file path
    crc: list[int] = field(default_factory=list)  # chunk checksums (verify=True)


@dataclass
class IOResult:
    """Outcome of one write or read."""

    loc: Any = None                                  # where a write put the bytes
    event: Any = None                                # CUDA event ending the copy (None: done on return)
    timing: tuple[Any, Any] | None = None            # CUDA events around the copy, for busy time
    seconds: float = 0.0                             # host-measured busy time when timing is None
    crc: list[int] = field(default_factory=list)     # chunk checksums (verify=True)
    cleanup: Callable[[], None] | None = None        # to run once ``event`` completed
    complete: bool = True                            # False: a write stopped early (tensor needed first)
    bytes_done: int = 0                              # bytes a write stopped early did write

    def busy_seconds(self) -> float:
        """Time the copy took (CUDA events when present, else the host clock)."""
        if self.timing is not None:
            return self.timing[0].elapsed_time(self.timing[1]) / 1e3
        return self.seconds


class Streams:
    """The store and load CUDA streams of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.store = torch.cuda.Stream(device)
        self.load = torch.cuda.Stream(device)


class Store(abc.ABC):
    """Where offloaded storages live between forward and backward (see the module docstring)."""

    kind: str = ""

    @abc.abstractmethod
    def reserve(self, nbytes: int) -> Slot | None:
        """Promise room for ``nbytes``; None when the store is full (the tensor then stays in memory)."""

    @abc.abstractmethod
    def unreserve(self, slot: Slot) -> None:
        """Give back the room of a slot that was never written (or whose write failed)."""

    @abc.abstractmethod
    def write(self, slot: Slot, src: torch.Tensor, ready: Any, streams: Streams | None, name: str,
              abort: Callable[[], bool]) -> IOResult:
        """Copy ``src`` (1-D ``uint8``) into ``slot`` once event ``ready`` completed.

        ``abort()`` True lets a long write stop early (the tensor is needed again first).
        """

    @abc.abstractmethod
    def read(self, slot: Slot, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             name: str) -> IOResult:
        """Copy the bytes of ``slot`` into ``dst`` (1-D ``uint8``, same size) after ``alloc_event``.

        A read consumes the slot: its room is released by the result's ``cleanup`` (run once the
        copy has completed), or before it returns when there is no cleanup.
        """

    @abc.abstractmethod
    def free(self, slot: Slot) -> bool:
        """Release the written copy of ``slot`` and its room; True when a file was removed."""

    def files(self) -> list[str]:
        """Names of the files the store has now (none for host memory)."""
        return []

    def where_full(self) -> str:
        """Where there was no room, for the warning of a storage kept because this store is full."""
        return f"the {self.kind} store (its budget is full)"

    def room(self) -> int | None:
        """Bytes `reserve` may still promise now; None where the store does not know (no fixed budget)."""
        return None

    @property
    def in_use(self) -> int:
        """Bytes held now."""
        return 0

    @property
    def peak_in_use(self) -> int:
        """Most bytes held at once since the last `reset_peak`."""
        return 0

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""

    def probe(self, nbytes: int, streams: Streams | None) -> tuple[float, float]:
        """Write then read ``nbytes`` through this store; (write, read) bytes/s."""
        device = streams.device if streams is not None else torch.device("cpu")
        # a private generator: the global RNG (dropout masks) must not move
        gen = torch.Generator(device=device).manual_seed(nbytes)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        dst = torch.empty_like(src)
        slot = self.reserve(nbytes)
        if slot is None:
            raise _no_room(self, nbytes)
        written = False
        res = None
        try:
            if src.is_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            res = slot.store.write(slot, src, None, streams, f"probe-{next(_probe_ids)}.tmp", lambda: False)
            if res.event is not None:
                res.event.synchronize()
            if res.cleanup is not None:
                res.cleanup()
            tw = time.perf_counter() - t0
            slot.loc, slot.crc, written = res.loc, res.crc, True
            t0 = time.perf_counter()
            written = False  # the read consumes the slot, even when it fails
            out = slot.store.read(slot, dst, None, streams, "probe")
            if out.event is not None:
                out.event.synchronize()
            if out.cleanup is not None:
                out.cleanup()
            tr = time.perf_counter() - t0
            if not torch.equal(src, dst):
                raise OSError(f"the {self.kind} bandwidth probe read back different bytes")
            return nbytes / max(tw, 1e-9), nbytes / max(tr, 1e-9)
        finally:
            if written:
                slot.store.free(slot)
            elif res is None:
                slot.store.unreserve(slot)

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (files and their directory, pinned memory)."""


def _no_room(store: Store, nbytes: int) -> OSError:
    from datapath.offload.errors import OffloadError  # noqa: PLC0415

    return OffloadError(f"no room for a {nbytes}-byte bandwidth probe in the {store.kind} store")
