"""A pool of pinned host memory for offloaded activations.

Large slabs come from `datapath._runtime.pinned_empty` (page-locked, so copies
to and from the GPU are asynchronous DMA); blocks are carved out of them
first-fit, 4 KiB aligned (O_DIRECT-ready), and merged again when freed.  Slabs
are kept for the life of the pool, so the first step sizes the pool and later
steps reuse it without pinning anything new.  ``budget`` caps the bytes handed
out; `try_reserve` lets the placement decision be made without allocating.
`HostPool.clear` drops the slabs and hands PyTorch's cached free pinned blocks back
to the driver (a freed slab otherwise stays pinned in the caching host allocator for
the life of the process).
"""
from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass

import torch

from datapath._runtime import pinned_empty

log = logging.getLogger("datapath.offload.host_pool")

ALIGN = 4096


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_empty(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A 1-D ``uint8`` host tensor of ``nbytes`` whose first byte is 4 KiB aligned."""
    if pinned:  # cudaHostAlloc blocks are page aligned: no slack needed (the allocator rounds to 2^k)
        raw = pinned_empty((nbytes,), torch.uint8)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = pinned_empty((nbytes + ALIGN,), torch.uint8)
    else:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + nbytes]


def release_cached_pinned() -> bool:
    """Give the free blocks PyTorch's caching host allocator keeps back to the driver (``cudaFreeHost``); blocks
    still in use stay.  False where there is nothing to call (no CUDA initialised, no such function)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    empty = getattr(torch._C, "_host_emptyCache", None)  # noqa: SLF001
    if empty is None:
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        return False
    empty()
    return True


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(eq=False)
class HostBlock:
    """``nbytes`` of pool memory: ``data`` is a 1-D ``uint8`` CPU tensor (pinned with CUDA)."""

    slab: int
    offset: int
    size: int
    nbytes: int
    data: torch.Tensor


class _Slab:
    def __init__(self, size: int, pinned: bool) -> None:
        self.size = size
        self.data = aligned_empty(size, pinned=pinned)
        self.free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, size)

    def alloc(self, size: int) -> int | None:
        for i, (off, sz) in enumerate(self.free):
            if sz >= size:
                if sz == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, sz - size)
                return off
        return None

    def release(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (off, 0))
        self.free.insert(i, (off, size))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self.free) and off + size == self.free[i + 1][0]:
            self.free[i] = (off, size + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]


class HostPool:
    """Pinned host memory handed out in 4 KiB-aligned blocks, within ``budget`` bytes."""

    def __init__(self, budget: int, slab_bytes: int = 256 << 20, pinned: bool | None = None) -> None:
        self.budget = int(budget)
        self.slab_bytes = int(slab_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()
        self.reserved = 0      # bytes promised to queued stores (<= budget)
        self.in_use = 0        # bytes in live blocks
        self.peak_in_use = 0

    @property
    def capacity(self) -> int:
        """Bytes of pinned memory held by the pool's slabs."""
        return sum(s.size for s in self._slabs)

    def try_reserve(self, nbytes: int) -> bool:
        """Promise ``nbytes`` (rounded to 4 KiB) to a future `alloc`; False when the budget would be exceeded."""
        size = round_up(nbytes)
        with self._lock:
            if self.reserved + size > self.budget:
                return False
            self.reserved += size
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.reserved -= round_up(nbytes)

    def alloc(self, nbytes: int) -> HostBlock:
        """A block of ``nbytes`` (already reserved).  Grows the pool by one slab when no free range fits."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            for si, slab in enumerate(self._slabs):
                off = slab.alloc(size)
                if off is not None:
                    return self._block(si, off, size, nbytes)
        # pin outside the lock: cudaHostAlloc of a large slab takes a while
        # PyTorch's pinned allocator hands out power-of-two blocks: ask for a whole one
        want = max(self.slab_bytes, size)
        slab = _Slab(_pow2(want) if self.pinned else want, self.pinned)
        with self._lock:
            self._slabs.append(slab)
            si = len(self._slabs) - 1
            off = slab.alloc(size)
            assert off is not None
            log.debug("host pool grew to %.2f GiB", self.capacity / 2**30)
            return self._block(si, off, size, nbytes)

    def _block(self, si: int, off: int, size: int, nbytes: int) -> HostBlock:
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return HostBlock(si, off, size, nbytes, self._slabs[si].data[off: off + nbytes])

    def free(self, block: HostBlock) -> None:
        """Return ``block`` to the pool (its reservation too)."""
        with self._lock:
            self._slabs[block.slab].release(block.offset, block.size)
            self.in_use -= block.size
            self.reserved -= block.size

    def clear(self) -> None:
        """Drop every slab (all blocks must have been freed) and, where they were pinned, hand the cached pinned
        memory back (`release_cached_pinned`)."""
        with self._lock:
            pinned = self.pinned and bool(self._slabs)
            self._slabs.clear()
        if pinned:
            try:
                release_cached_pinned()
            except RuntimeError as exc:  # at interpreter exit, or a CUDA error of a step: the memory goes at exit
                log.debug("cached pinned memory not released: %s", exc)
