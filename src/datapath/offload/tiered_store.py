"""`TieredStore`: pinned host memory first, files once the host budget is full."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from datapath.offload.file_store import FileStore
from datapath.offload.host_store import HostStore
from datapath.offload.store import IOResult, Slot, Store, Streams


class TieredStore(Store):
    """A `HostStore` spilling to a `FileStore`: a slot lives in the first tier with room."""

    kind = "tiered"

    def __init__(self, host: HostStore, files: FileStore) -> None:
        self.host = host
        self.file = files
        self.tiers: tuple[Store, ...] = (host, files)

    def reserve(self, nbytes: int) -> Slot | None:
        for tier in self.tiers:
            slot = tier.reserve(nbytes)
            if slot is not None:
                return slot
        return None

    def unreserve(self, slot: Slot) -> None:
        slot.store.unreserve(slot)

    def room(self) -> int | None:
        rooms = [tier.room() for tier in self.tiers]
        return None if None in rooms else sum(r for r in rooms if r is not None)

    def write(self, slot: Slot, src: torch.Tensor, ready: Any, streams: Streams | None, name: str,
              abort: Callable[[], bool]) -> IOResult:
        return slot.store.write(slot, src, ready, streams, name, abort)

    def read(self, slot: Slot, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             name: str) -> IOResult:
        return slot.store.read(slot, dst, alloc_event, streams, name)

    def free(self, slot: Slot) -> bool:
        return slot.store.free(slot)

    def files(self) -> list[str]:
        return self.file.files()

    @property
    def in_use(self) -> int:
        return self.host.in_use + self.file.in_use

    @property
    def peak_in_use(self) -> int:
        return self.host.peak_in_use + self.file.peak_in_use

    def reset_peak(self) -> None:
        self.host.reset_peak()
        self.file.reset_peak()

    def close(self) -> None:
        self.host.close()
        self.file.close()
