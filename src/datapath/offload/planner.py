"""Adaptive offloading: from one profiled step, choose how much to offload (SSDTrain §5.3.5).

Offloading only helps until the memory peak at the start of backward; a store
that cannot finish before its tensor is needed again, or a load that cannot
finish before the backward reaches it, slows the step down or wastes
bandwidth.  The profile of one step gives, in forward order, every offloadable
storage (the segment it was packed in, its size, when it was ready), each
segment's forward and backward start times, and the measured write and read
bandwidth of the target.  `plan_offload` simulates the store queue (FIFO, one
storage after the other at the write bandwidth) and the load queue (segments in
reverse forward order, each issued from the backward pre-hook of the segment
``prefetch_distance`` units later, at the read bandwidth) for every prefix of
the storages, and keeps the longest prefix for which every store finishes
before its segment's backward starts and the loads delay the backward by at
most ``stall_tolerance`` of the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SegmentProfile:
    """One forward segment: a unit module call, or the code between units (times in seconds from step start)."""

    is_unit: bool
    forward_start: float
    forward_end: float
    backward_start: float | None = None  # when its backward began (None: not observed)


@dataclass(frozen=True)
class TensorProfile:
    """One offloadable storage, in the order its first pack happened."""

    segment: int
    nbytes: int
    ready: float  # seconds from step start when the producing op had finished


@dataclass
class StepProfile:
    """What one profiled step measured."""

    segments: list[SegmentProfile]
    tensors: list[TensorProfile]
    backward_start: float  # when the backward of the whole step began
    write_bandwidth: float  # bytes/s the target achieved for stores
    read_bandwidth: float  # bytes/s the target achieved for loads
    backward_ratio: float = 2.0  # backward time / forward time used where a backward start was not observed

    def _ratio(self) -> float:
        """Backward/forward time ratio calibrated on the measured unit backward starts (else ``backward_ratio``)."""
        seen = [i for i, s in enumerate(self.segments) if s.backward_start is not None]
        if len(seen) >= 2:
            lo, hi = seen[0], seen[-1]
            bwd = self.segments[lo].backward_start - self.segments[hi].backward_start  # type: ignore[operator]
            fwd = self.segments[hi - 1].forward_end - self.segments[lo].forward_start
            if fwd > 0 and bwd > 0:
                return bwd / fwd
        return self.backward_ratio

    def backward_starts(self) -> list[float]:
        """Backward start of every segment: measured where seen, else the previous one plus ratio x forward time."""
        ratio = self._ratio()
        out = [0.0] * len(self.segments)
        t = self.backward_start
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            out[i] = seg.backward_start if seg.backward_start is not None else t
            t = out[i] + max(seg.forward_end - seg.forward_start, 0.0) * ratio
        return out

    @property
    def step_time(self) -> float:
        """Estimated time of forward plus backward."""
        if not self.segments:
            return self.backward_start
        seg = self.segments[0]
        return self.backward_starts()[0] + max(seg.forward_end - seg.forward_start, 0.0) * self._ratio()


@dataclass
class OffloadPlan:
    """The decision: offload the first ``cutoff`` offloadable storages of every forward, keep the rest."""

    cutoff: int
    prefetch_distance: int
    bytes_planned: int
    bytes_total: int
    write_bandwidth: float
    read_bandwidth: float
    predicted_stall: float
    step_time: float
    bytes_allowed: float = 0.0  # bytes that can be written and read back in one step: step / (1/w + 1/r)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in (
            "cutoff", "prefetch_distance", "bytes_planned", "bytes_total", "write_bandwidth",
            "read_bandwidth", "predicted_stall", "step_time", "bytes_allowed")}


def _issue_times(profile: StepProfile, bwd: list[float], distance: int) -> list[float]:
    """When the prefetch of each segment is issued: the backward start of the ``distance``-th unit after it."""
    n = len(profile.segments)
    units = [i for i, s in enumerate(profile.segments) if s.is_unit]
    first_bwd = min(bwd) if bwd else profile.backward_start
    out = []
    for i in range(n):
        later = [u for u in units if u > i]
        out.append(bwd[later[distance - 1]] if len(later) >= distance else min(first_bwd, profile.backward_start))
    return out


def simulate(profile: StepProfile, cutoff: int, distance: int, write_bw: float, read_bw: float,
             shared_channel: bool = False) -> tuple[bool, float]:
    """(stores all finish in time, total backward stall in seconds) when offloading ``tensors[:cutoff]``.

    ``shared_channel``: stores and loads share one device (a disk): no load starts before the
    last store has finished.  Host memory over PCIe has separate directions (False).
    """
    bwd = profile.backward_starts()
    tensors = profile.tensors[:cutoff]
    t = 0.0
    done: list[float] = []
    for tp in tensors:
        t = max(t, tp.ready) + tp.nbytes / write_bw
        done.append(t)
        if t > bwd[tp.segment]:
            return False, math.inf
    issue = _issue_times(profile, bwd, distance)
    by_seg: dict[int, list[int]] = {}
    for k, tp in enumerate(tensors):
        by_seg.setdefault(tp.segment, []).append(k)
    stall = 0.0
    t = done[-1] if shared_channel and done else 0.0
    for s in sorted(by_seg, reverse=True):
        for k in by_seg[s]:
            t = max(t, issue[s] + stall, done[k]) + tensors[k].nbytes / read_bw
        late = t - (bwd[s] + stall)
        if late > 0:
            stall += late
    return True, stall


def plan_offload(profile: StepProfile, *, stall_tolerance: float = 0.02, safety: float = 0.9,
                 max_distance: int | None = None, write_bandwidth: float | None = None,
                 read_bandwidth: float | None = None, shared_channel: bool = False) -> OffloadPlan:
    """The longest prefix of ``profile.tensors`` that can be offloaded without slowing the step.

    Bandwidths default to the profile's measured ones, scaled by ``safety``.  Every prefetch
    distance up to ``max_distance`` units (default: all) is tried; the most bytes win, the
    shortest distance among equals (loads held in memory for the least time) or, with
    ``shared_channel`` (files on one disk, see `simulate`), the longest (loads start early).
    """
    w = (write_bandwidth or profile.write_bandwidth) * safety
    r = (read_bandwidth or profile.read_bandwidth or profile.write_bandwidth) * safety
    total = sum(tp.nbytes for tp in profile.tensors)
    step = profile.step_time
    budget = stall_tolerance * step
    best = (0, 1, 0.0)
    if w > 0 and r > 0 and profile.tensors:
        n_units = sum(1 for seg in profile.segments if seg.is_unit)
        for d in range(1, max(1, max_distance or n_units) + 1):
            lo, hi = 0, len(profile.tensors)  # feasibility is monotone in the prefix length
            while lo < hi:
                mid = (lo + hi + 1) // 2
                ok, stall = simulate(profile, mid, d, w, r, shared_channel)
                if ok and stall <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            # most bytes win; among equals the shortest distance (loads held in memory for the least
            # time), except on a shared disk, where loads start as early as they can (a few, slow reads:
            # the margin matters more than the memory they hold)
            if lo > best[0] or (shared_channel and lo == best[0] and lo > 0):
                best = (lo, d, simulate(profile, lo, d, w, r, shared_channel)[1])
    cutoff, dist, stall = best
    return OffloadPlan(
        cutoff=cutoff, prefetch_distance=dist,
        bytes_planned=sum(tp.nbytes for tp in profile.tensors[:cutoff]), bytes_total=total,
        write_bandwidth=w, read_bandwidth=r, predicted_stall=stall, step_time=step,
        bytes_allowed=min(float(total), step / (1 / w + 1 / r)) if w > 0 and r > 0 else 0.0,
    )
