"""The profiled step of ``memory_budget=`` against a store too small for its activations.

Where the store cannot hold every activation of the profiled step (a long sequence
against the host's pinned budget), what it refuses would stay on the device and the
step would need more memory than keeping everything.  `StoreRoom` watches the store's
room (`Store.room`) before the profiled step's stores: at the first store of each block
it compares the room left with the blocks still to run times the largest block stored
so far, and when they would not fit (or a store is about to be refused) the blocks that
would not fit are recomputed from the next block on (a block's forward is looked up
when it is called, so this takes effect in the same forward).  The next step is then
profiled with every block recomputed (`StoreRoom.reprofile`), and every plan recomputes
`StoreRoom.base_recompute`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import nn

from datapath.offload.recompute import already_recomputed, clear_recompute, is_recomputed, set_recompute
from datapath.offload.records import Record

log = logging.getLogger("datapath.offload")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class StoreRoom:
    """What the budget policy knows of the store's room during its profiled steps.

    ``room`` returns the bytes the store may still take (None, or returning None: not known).
    ``full``: the profiled step's activations did not all fit the store; ``base_recompute``: the
    blocks every plan recomputes once they did not (the second profile recomputes them);
    ``block_bytes_max``: the most bytes one block of the first profiled step saved.
    """

    def __init__(self, room: Callable[[], int | None] | None) -> None:
        self.room = room
        self.full = False
        self.base_recompute: tuple[int, ...] = ()
        self.block_bytes_max = 0
        self._seen_block = -1     # the profiled step's last block whose first store was seen

    def step_started(self, blocks: Sequence[nn.Module]) -> None:
        """A profiled step begins: after a store too small, every block is recomputed in it."""
        self._seen_block = -1
        if self.base_recompute:
            set_recompute(blocks, self.base_recompute)

    def watch(self, rec: Record, nbytes: int, blocks: Sequence[nn.Module]) -> None:
        """Before a store of ``nbytes`` of the profiled step ``rec``: where the blocks still to run would not
        fit the store's room, recompute those that would not (they would stay on the device otherwise)."""
        if self.base_recompute:
            return
        room = self.room() if self.room is not None else None
        if room is None:
            return
        b = rec.segments[-1].block if rec.segments else -1
        if 0 <= b < len(blocks) and b > self._seen_block:  # the first store of block b
            self._seen_block = b
            per: dict[int, int] = {}
            for si, nb, _ in rec.tensors[:-1]:  # the last one is this storage (recorded before its store)
                bb = rec.segments[si].block
                if 0 <= bb < b:
                    per[bb] = per.get(bb, 0) + nb
            most = max(per.values(), default=0)
            self.block_bytes_max = max(self.block_bytes_max, most)
            todo = [i for i in range(b, len(blocks))
                    if not already_recomputed(blocks[i]) and not is_recomputed(blocks[i])]
            if most and room < len(todo) * most:
                fit = int(room // most) - 1  # blocks after b that still fit (b itself takes one share)
                self._overflow(blocks, b + 1 + max(0, fit), room, len(todo) * most)
                return
        if room < nbytes:  # this store will be refused: recompute every block after this one
            self._overflow(blocks, b + 1 if b >= 0 else len(blocks), room, nbytes)

    def _overflow(self, blocks: Sequence[nn.Module], start: int, room: int, need: int) -> None:
        """Recompute every block from ``start`` on."""
        on = {i for i, blk in enumerate(blocks) if is_recomputed(blk)}
        new = {i for i in range(start, len(blocks)) if not already_recomputed(blocks[i])}
        if not self.full:
            log.info("memory budget: the store has room for %s, the profiled step needs %s more; blocks %d.. are "
                     "recomputed, and the next step is profiled with every block recomputed", _gb(room),
                     _gb(need), start)
        self.full = True
        if new - on:
            set_recompute(blocks, sorted(on | new))

    def reprofile(self, rec: Record, blocks: Sequence[nn.Module]) -> dict[int, int] | None:
        """The profiled step ``rec`` did not fit the store: the next is profiled with every block recomputed
        and every other storage offloaded.  Returns the bytes each block of ``rec`` saved (a recomputed
        block's activations come back at once in its backward), or None where no block can be recomputed
        (``rec`` stays the profile)."""
        if not self.full or self.base_recompute:
            return None
        base = tuple(i for i in range(len(blocks)) if not already_recomputed(blocks[i]))
        if not base:
            return None
        per: dict[int, int] = {}
        for si, nb, _ in rec.tensors:
            b = rec.segments[si].block
            if b >= 0:
                per[b] = per.get(b, 0) + nb
        self.base_recompute = base
        clear_recompute(blocks)
        return per
