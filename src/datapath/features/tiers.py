"""What every tier of a `FeatureStore` reports (`TierStats`), and the interface of tiers the GPU cannot address.

Tiers the GPU reads directly (the GPU cache, pinned host memory) are served together by
one kernel (`datapath.memory.gather_tiered`).  The others implement `FetchTier`: the
store hands each the ids it owns and the output positions they go to, and the tier fills
them (the disk tier, `datapath.features.disk.DiskTier`; a remote shard of a
``torch.distributed`` group would be one more).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TierStats:
    """Rows served by one tier since the last reset.

    ``rows``: rows it returned; ``bytes``: their bytes; ``seconds``: time spent in the tier
    (wall time of the fetch for fetch tiers; for the GPU-read tiers, the GPU time of the
    gathers that read them, shared); ``extra``: tier-specific counters (e.g. the disk tier's
    reads and bytes read, which include whole pages).
    """

    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, rows: int = 0, nbytes: int = 0, seconds: float = 0.0, **extra: Any) -> None:
        """Add to the counters and to ``extra``'s (each ``extra[k] += v``; a list's ``v``: items appended), all
        under the lock `snapshot` reads and zeroes under, so that a reset falls wholly before or after the call."""
        with self._lock:
            self.rows += rows
            self.bytes += nbytes
            self.seconds += seconds
            for k, v in extra.items():
                if isinstance(self.extra[k], list):
                    self.extra[k].extend(v)
                else:
                    self.extra[k] += v

    def reset(self) -> dict[str, Any]:
        """Zero the counters; returns them as they were (`snapshot`), read and zeroed at once."""
        return self.snapshot(reset=True)

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        """The counters (rows, bytes, seconds and ``extra``) read at one instant; with ``reset``, zeroed in the same
        instant (under the lock every `add` takes), so that a count is either in the snapshot or kept."""
        with self._lock:
            out = {"rows": self.rows, "bytes": self.bytes, "seconds": self.seconds,
                   **{k: list(v) if isinstance(v, list) else v for k, v in self.extra.items()}}
            if reset:
                self.rows = self.bytes = 0
                self.seconds = 0.0
                for k, v in self.extra.items():
                    self.extra[k] = type(v)()
            return out

    def as_dict(self, total_rows: int) -> dict[str, Any]:
        """The counters plus ``hit_rate`` (share of all rows the store returned that came from this tier)."""
        return with_hit_rate(self.snapshot(), total_rows)


def with_hit_rate(snapshot: dict[str, Any], total_rows: int) -> dict[str, Any]:
    """A tier's `TierStats.snapshot` with ``hit_rate`` (its share of ``total_rows``) after its seconds."""
    rest = {k: v for k, v in snapshot.items() if k not in ("rows", "bytes", "seconds")}
    rows = snapshot["rows"]
    return {"rows": rows, "bytes": snapshot["bytes"], "seconds": snapshot["seconds"],
            "hit_rate": rows / total_rows if total_rows else 0.0, **rest}


class FetchTier(ABC):
    """A tier whose rows the GPU cannot address: it is asked for ids and writes their rows into the batch.

    A ``collective`` tier (the shards of a ``torch.distributed`` group) is called on every gather,
    also with no ids, so that every rank enters its exchange the same number of times in the same
    order; when the gather fails before the exchange, the store calls its `abort` instead.
    ``rows``: the table rows only this tier serves (None: those in no other tier).
    """

    name: str = "fetch"
    collective: bool = False
    rows: int | None = None
    reads_slots: bool = False
    """Whether the tier implements `fetch_slots` (finds its rows in the store's slot lookup itself)."""

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def fetch(self, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """``out[positions] = rows ids`` (ids: (k,) int64 row numbers of the whole table; positions: (k,) int64 on
        ``out``'s device).  Work queued on the current CUDA stream is ordered before the batch's consumers."""

    def fetch_slots(self, ids: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, flag: Any = None) -> None:
        """``out[k] = row ids[k]`` for every ``k`` with ``loc[k] < 0`` (the store's only fetch tier; ids: (m,) int
        row numbers, negatives from the end; loc: (m,) int32 slots; both on ``out``'s device).  Unlike `fetch`, the
        tier picks its rows on the device, so the store makes no host synchronisation for it.  ``flag``: the
        lookup's `ErrorFlag`, if any (a bad id is raised through it)."""
        raise NotImplementedError(f"{type(self).__name__} does not read the slot lookup (reads_slots is False)")

    def abort(self, error: BaseException) -> None:
        """This rank's gather failed with ``error`` before calling `fetch` (a collective tier tells the others)."""

    def close(self) -> None:
        """Release files and buffers (idempotent)."""
