"""`HostStore`: offloaded storages in pinned host memory, carved from a pool of large slabs.

Slabs are pinned once (the first step sizes the pool) and reused: a store never
pins memory per tensor and never synchronises the host per tensor; on CUDA a
write is one asynchronous copy on the store stream, a read one on the load stream.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from datapath.offload._host_pool import HostBlock, HostPool
from datapath.offload.errors import OffloadError
from datapath.offload.store import IOResult, Slot, Store, Streams, crc32


class HostStore(Store):
    """Pinned host memory from a `HostPool` of at most ``budget`` bytes."""

    kind = "host"

    def __init__(self, budget: int, *, slab_bytes: int = 256 << 20, verify: bool = False,
                 pinned: bool | None = None) -> None:
        self.pool = HostPool(budget, slab_bytes=slab_bytes, pinned=pinned)
        self.verify = verify

    @property
    def budget(self) -> int:
        return self.pool.budget

    def reserve(self, nbytes: int) -> Slot | None:
        return Slot(self, nbytes) if self.pool.try_reserve(nbytes) else None

    def unreserve(self, slot: Slot) -> None:
        self.pool.unreserve(slot.nbytes)

    def room(self) -> int | None:
        return max(0, self.pool.budget - self.pool.reserved)

    def write(self, slot: Slot, src: torch.Tensor, ready: Any, streams: Streams | None, name: str,
              abort: Callable[[], bool]) -> IOResult:
        block = self.pool.alloc(src.numel())
        if src.is_cuda:
            assert streams is not None
            s = streams.store
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                if ready is not None:
                    s.wait_event(ready)
                start.record(s)
                block.data.copy_(src, non_blocking=True)
                end.record(s)
            res = IOResult(loc=block, event=end, timing=(start, end), bytes_done=src.numel())
            if self.verify:
                res.cleanup = lambda: res.crc.append(crc32(block.data))
            return res
        t0 = time.perf_counter()
        block.data.copy_(src)
        res = IOResult(loc=block, seconds=time.perf_counter() - t0, bytes_done=src.numel())
        if self.verify:
            res.crc.append(crc32(block.data))
        return res

    def read(self, slot: Slot, dst: torch.Tensor, alloc_event: Any, streams: Streams | None,
             name: str) -> IOResult:
        block: HostBlock = slot.loc
        if self.verify and slot.crc and crc32(block.data) != slot.crc[0]:
            self.free(slot)
            raise OffloadError(f"checksum mismatch reloading {name} from host memory: the pinned copy was "
                               f"overwritten; this is a bug, please report it")
        if dst.is_cuda:
            assert streams is not None
            s = streams.load
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                if alloc_event is not None:
                    s.wait_event(alloc_event)
                start.record(s)
                dst.copy_(block.data, non_blocking=True)
                end.record(s)
            return IOResult(event=end, timing=(start, end), cleanup=lambda: self.free(slot))
        t0 = time.perf_counter()
        dst.copy_(block.data)
        self.free(slot)
        return IOResult(seconds=time.perf_counter() - t0)

    def free(self, slot: Slot) -> bool:
        block, slot.loc = slot.loc, None
        if block is not None:
            self.pool.free(block)
        return False

    @property
    def in_use(self) -> int:
        return self.pool.in_use

    @property
    def peak_in_use(self) -> int:
        return self.pool.peak_in_use

    def reset_peak(self) -> None:
        self.pool.peak_in_use = self.pool.in_use

    def close(self) -> None:
        self.pool.clear()
