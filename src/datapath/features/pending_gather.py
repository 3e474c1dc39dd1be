"""`PendingGather`: a `FeatureStore` gather in parts (`FeatureStore.start_gather`).

The rows the GPU addresses (its cache, pinned host memory) are read when the gather starts; the
rest come from the store's fetch tiers (disk, other ranks' shards) when it finishes.  A collective
tier's exchange can be split further (`PendingGather.prepare`, `start`, `read`, `finish`), so that
a loader runs its collectives in its turns.
"""
from __future__ import annotations

from typing import Any

import torch

from datapath.features.superbatch import Schedule
from datapath.memory import ErrorFlag


class PendingGather:
    """A `FeatureStore` gather whose GPU-read rows are launched and whose fetch tiers' rows are still to come.

    ``store``: the `FeatureStore` that started it; ``out``: (*idx.shape, *rest) on the store's device,
    complete once `finish` has run (and the work it queued on the then current stream is done).
    """

    def __init__(self, store: Any, out: torch.Tensor, shape: tuple[int, ...],
                 flat: torch.Tensor | None = None, loc: torch.Tensor | None = None,
                 own_flag: ErrorFlag | None = None, schedule: Schedule | None = None,
                 step: int | None = None) -> None:
        self.store = store
        self._rows = out
        self.out = out.view(shape)
        self._args = None if flat is None else (flat, loc, own_flag, schedule, step)
        self._split: Any = None  # a collective tier's exchange in parts, prepared (`prepare`)

    def prepare(self) -> bool:
        """Prepare a collective tier's exchange on the current stream, submitting no collective: its ids sorted
        by owner, the buffers of its counts.

        True when the fetch is split so (one collective tier that reads the slot map, no superbatch
        schedule): then `start` submits the counts all_gather (not waited for), `read` waits for the counts
        (the host synchronisation) and prepares the rest, and `finish` submits the rest, each on the stream
        current then.  False: `finish` does the whole fetch, as without `prepare`.  An error is raised without
        telling the other ranks (that takes a collective): the caller takes the exchange's place with the
        store's `abort`.
        """
        if self._split is not None:
            return True
        tier = self._splittable()
        if tier is None:
            return False
        flat, loc, own_flag, _, _ = self._args
        self._split = tier.prepare_fetch_slots(flat, loc, self._rows, own_flag)
        self._args = None
        return True

    def start(self) -> bool:
        """Submit the first part of a collective tier's exchange (its counts) on the current stream, without waiting
        (`prepare` first, if not done: an error there tells the other ranks, in the collective's place).

        Returns what `prepare` returns.
        """
        try:
            if not self.prepare():
                return False
        except Exception as exc:
            self.store.abort(exc)
            raise
        self._split.submit()
        return True

    def _splittable(self) -> Any:
        """The one collective tier that fetches this gather's rows in parts, or None."""
        if self._args is None:
            return None
        fetch = self.store._fetch
        if (len(fetch) == 1 and fetch[0].collective and fetch[0].reads_slots and self._args[3] is None
                and hasattr(fetch[0], "prepare_fetch_slots")):
            return fetch[0]
        return None

    def read(self) -> None:
        """After `start`: wait for the exchange's counts (raises if a rank failed) and prepare the rest; nothing
        otherwise."""
        if self._split is not None:
            self._split.read()

    def tensors(self) -> list[torch.Tensor]:
        """The CUDA tensors `finish` reads or writes (another stream that finishes records them)."""
        return [self._rows] + ([] if self._args is None else [self._args[0], self._args[1]])

    def finish(self) -> torch.Tensor:
        """Fetch the remaining rows into ``out`` (queued on the current stream); idempotent.  Returns ``out``."""
        split, self._split = self._split, None
        if split is not None:
            split.finish()
        args, self._args = self._args, None
        if args is not None:
            flat, loc, own_flag, schedule, step = args
            self.store._fetch_missing(flat, loc, self._rows, own_flag, schedule, step)
        return self.out
