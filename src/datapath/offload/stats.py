"""Counters of a `TensorCache`: what was offloaded, kept, deduplicated, forwarded, and how fast."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class OffloadStats:
    """Cumulative counters since the cache was built (or `TensorCache.reset_stats`).

    Byte counts are of storages (what moves) except ``bytes_deduplicated`` and
    the ``bytes_kept_*`` counters, which count the saved tensor views.
    """

    records: int = 0               # forward passes seen (one per micro-batch)
    records_unhooked: int = 0      # ... of them run without the saved-tensor hooks (a plan that stores nothing)
    microbatch_hints: int = 0      # set_microbatch calls (pipeline schedule hints)
    packs: int = 0                 # saved tensors offered by autograd
    packs_quiet: int = 0           # ... of them kept at once: a planned step past the segments it offloads
    packs_recomputed: int = 0      # ... of them elementwise outputs, recomputed in backward (op_recompute)
    unpacks: int = 0               # saved tensors handed back to autograd
    storages_offloaded: int = 0    # storages queued for the target
    bytes_queued: int = 0          # their bytes (what was chosen for offloading, whatever timing did next)
    bytes_offloaded: int = 0       # bytes written to the target (host memory or files)
    bytes_written_partial: int = 0  # bytes written by stores stopped early (tensor needed first): bandwidth only
    bytes_loaded: int = 0          # bytes read back to the device
    loads_prefetched: int = 0      # loads started by a prefetch (backward pre-hook or hint)
    loads_on_demand: int = 0       # loads started only when autograd asked for the tensor
    bytes_deduplicated: int = 0    # saved views whose storage was already in the cache (not written again)
    dedup_hits: int = 0
    bytes_forwarded: int = 0       # storages handed back from memory while queued or being stored
    stores_cancelled: int = 0      # queued stores dropped because the tensor was needed (or freed) first
    bytes_kept_param: int = 0      # parameters, buffers and views of them
    bytes_kept_small: int = 0      # storages under min_bytes
    bytes_kept_cpu: int = 0        # CPU tensors (unless offload_cpu_tensors)
    bytes_kept_policy: int = 0     # last modules / beyond the adaptive plan
    bytes_kept_backward: int = 0   # saved during backward (checkpoint recomputation, double backward)
    bytes_kept_budget: int = 0     # the host budget or disk budget was full
    bytes_kept_error: int = 0      # the store failed and on_error="keep" kept the tensor
    bytes_kept_other: int = 0      # tensor subclasses, sparse, quantized, meta tensors
    bytes_recomputed_ops: int = 0  # elementwise outputs recomputed from saved inputs in backward (not saved)
    store_errors: int = 0
    load_errors: int = 0
    write_seconds: float = 0.0     # busy time of the store path
    read_seconds: float = 0.0      # busy time of the load path
    unpack_wait_seconds: float = 0.0  # time autograd was blocked in unpack waiting for a load
    store_wait_seconds: float = 0.0   # time pack hooks waited for stores (backpressure)
    peak_inflight_bytes: int = 0      # most bytes waiting to be stored at once
    peak_prefetch_bytes: int = 0      # most bytes loaded ahead by prefetches and not yet used at once
    plan_backoffs: int = 0            # adaptive plans shortened because the backward waited for loads
    plan_corrections: int = 0         # budget plans made again because a step's peak exceeded the budget
    files_created: int = 0
    files_removed: int = 0
    peak_disk_bytes: int = 0
    peak_host_bytes: int = 0
    prefetch_order: list[tuple[int, int]] = field(default_factory=list)  # (record, segment) as issued

    @property
    def write_bandwidth(self) -> float:
        """Achieved store bandwidth in bytes/s (0 when nothing was stored)."""
        done = self.bytes_offloaded + self.bytes_written_partial
        return done / self.write_seconds if self.write_seconds > 0 else 0.0

    @property
    def read_bandwidth(self) -> float:
        """Achieved load bandwidth in bytes/s (0 when nothing was loaded)."""
        return self.bytes_loaded / self.read_seconds if self.read_seconds > 0 else 0.0

    @property
    def bytes_kept(self) -> int:
        return (self.bytes_kept_param + self.bytes_kept_small + self.bytes_kept_cpu + self.bytes_kept_policy
                + self.bytes_kept_backward + self.bytes_kept_budget + self.bytes_kept_error + self.bytes_kept_other)

    def reset(self) -> "OffloadStats":
        """Zero every counter in place (whoever holds this object sees new counters); a copy of the old ones."""
        old = dataclasses.replace(self)
        fresh = OffloadStats()
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
        return old

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefetch_order"] = [list(x) for x in self.prefetch_order[-64:]]
        d["write_bandwidth"] = self.write_bandwidth
        d["read_bandwidth"] = self.read_bandwidth
        return d
