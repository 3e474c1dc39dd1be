"""Policies: which saved storages leave device memory, and how fast bytes may be in flight.

- `AllPolicy` (``policy="all"``): every candidate storage except those of the last
  ``keep_last_modules`` units.  Stores are admitted only as fast as they drain: the
  bytes in flight are bounded by what the store moves in `INFLIGHT_WINDOW_S` at its
  measured bandwidth (at least two of the largest storages), and so are the bytes
  loaded ahead in the backward.  No byte-valued setting to find.
- `AdaptivePolicy` (``policy="adaptive"``): profiles one step, then offloads the longest
  prefix of storages whose stores and loads fit the measured bandwidth without
  slowing the step (`datapath.offload.planner`); re-plans when the bandwidth moves,
  backs off when the backward waits for loads.
- `BudgetPolicy` (``memory_budget=``, in `datapath.offload.budget`): keep, offload or
  recompute, planned to fit a memory budget.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Protocol

from datapath.offload.bandwidth import StoreBandwidth
from datapath.offload.config import OffloadConfig
from datapath.offload.planner import OffloadPlan, SegmentProfile, StepProfile, TensorProfile, plan_offload
from datapath.offload.records import Clock, Record, Segment
from datapath.offload.stats import OffloadStats

log = logging.getLogger("datapath.offload.policy")

INFLIGHT_WINDOW_S = 0.01  # bytes in flight: what the store moves in 10 ms at its measured bandwidth


class Backpressure(Protocol):
    """What a policy needs of the transfers: the bytes waiting to be stored, and waiting for them to drain."""

    inflight_bytes: int

    def admit(self, nbytes: int, bound: float) -> float: ...

    def admit_until(self, ready: Callable[[], bool]) -> float: ...


class Policy:
    """The decisions the saved-tensor and module hooks delegate (all called with the cache's lock held).

    ``config``: the cache's settings; ``flow``: the transfers' backpressure; ``bandwidth``: the store's
    measured bandwidth; ``stats``: the cache's counters (a policy adds its plan changes).
    """

    name = ""

    def __init__(self, config: OffloadConfig, flow: Backpressure, bandwidth: StoreBandwidth,
                 stats: OffloadStats) -> None:
        self.config = config
        self.flow = flow
        self.bandwidth = bandwidth
        self.stats = stats
        # the largest storage offloaded so far: not tracked (stays 0), so the derived bounds are the
        # bandwidth windows alone and the budget's memory profile drains every store before the next
        self.max_storage_bytes = 0
        self.plan: object | None = None

    def on_step_start(self) -> None:
        """The root module's forward begins."""

    def on_record_start(self, rec: Record) -> None:
        """Set up a new forward record (profiling, plan, prefetch distance)."""
        rec.distance = self.config.flow.prefetch_distance

    def on_record_dropped(self, rec: Record) -> None:
        """``rec`` saved nothing offloadable and is forgotten."""

    def on_backward_end(self, rec: Record) -> None:
        """The backward of ``rec`` has finished (autograd's engine, at the end of its graph task)."""

    def on_record_done(self, rec: Record) -> None:
        """Every saved tensor of ``rec`` was consumed or freed."""

    def close(self) -> None:
        """The cache is closing, its models still attached: leave nothing of the policy on them."""

    def decide(self, rec: Record, seg: Segment, idx: int, nbytes: int) -> bool:
        """Offload the ``idx``-th new storage of ``rec`` (``nbytes``, saved in ``seg``)?"""
        n = rec.expected_units
        return not (n is not None and seg.unit_pos > n - self.config.select.keep_last_modules)

    def inflight_bound(self, rec: Record) -> float:
        """Device bytes that may wait to be stored before a pack waits."""
        v = self.config.flow.max_inflight_bytes
        return math.inf if v is None else float(v)

    def admit(self, rec: Record, nbytes: int) -> float:
        """Backpressure before a store of ``nbytes`` is queued; the seconds waited."""
        return self.flow.admit(nbytes, self.inflight_bound(rec))

    def admit_kept(self, rec: Record, nbytes: int) -> float:
        """Backpressure before a storage of ``nbytes`` is kept in device memory; the seconds waited."""
        return 0.0

    def prefetch_bound(self, rec: Record) -> float:
        """Bytes one backward step may start loading beyond the segment it needs now."""
        v = self.config.flow.max_prefetch_bytes
        return math.inf if v is None else float(v)

    def paces(self, rec: Record) -> bool:
        """Whether the CPU is paced to the GPU during ``rec``."""
        return True

    def stores_nothing(self, rec: Record) -> bool:
        """Whether ``rec`` neither stores nor measures what it saves (its forward can run without the
        saved-tensor hooks: every saved tensor would be kept as it is)."""
        return False

    def forward_lead(self, rec: Record, segment: int, lead: int) -> int:
        """Units the CPU may run ahead of the GPU when the forward enters a unit at ``segment``: ``lead``,
        and 0 in the last eighth of the forward, where the peak forms (a unit is launched only once the GPU
        has finished the one before: its stores have had that much more time)."""
        n = rec.expected_units
        return 0 if n and rec.units > n - max(1, n // 8) else lead


def derived_bound(max_storage_bytes: int, bandwidth: float) -> float:
    """Bytes the store moves in `INFLIGHT_WINDOW_S`, at least two of the largest storages seen."""
    return max(2.0 * max_storage_bytes, bandwidth * INFLIGHT_WINDOW_S)


class AllPolicy(Policy):
    """Offload every candidate storage, admitted as fast as the store drains them."""

    name = "all"

    def inflight_bound(self, rec: Record) -> float:
        v = self.config.flow.max_inflight_bytes
        if v is not None:
            return float(v)
        return derived_bound(self.max_storage_bytes, self.bandwidth.now()[0])

    def prefetch_bound(self, rec: Record) -> float:
        v = self.config.flow.max_prefetch_bytes
        if v is not None:
            return float(v)
        return derived_bound(self.max_storage_bytes, self.bandwidth.now()[1])


class AdaptivePolicy(Policy):
    """Profile a step, then offload what the measured bandwidth can move without slowing the step."""

    name = "adaptive"

    def __init__(self, config: OffloadConfig, flow: Backpressure, bandwidth: StoreBandwidth,
                 stats: OffloadStats) -> None:
        super().__init__(config, flow, bandwidth, stats)
        self.plan: OffloadPlan | None = None
        self.profile: StepProfile | None = None
        self._profiling: Record | None = None
        self._records = 0
        self._retries = 0

    def on_record_start(self, rec: Record) -> None:
        self._maybe_plan()
        flow = self.config.flow
        rec.profiling = self.plan is None and self._profiling is None and self._records >= flow.profile_after
        self._records += 1
        if self.plan is not None:
            rec.cutoff = self.plan.cutoff
            rec.distance = self.plan.prefetch_distance
        else:
            rec.distance = flow.prefetch_distance
        if rec.profiling:
            self._profiling = rec

    def on_record_dropped(self, rec: Record) -> None:
        if self._profiling is rec:
            self._profiling = None

    def decide(self, rec: Record, seg: Segment, idx: int, nbytes: int) -> bool:
        if rec.cutoff is not None:
            return idx < rec.cutoff
        return super().decide(rec, seg, idx, nbytes)

    def on_record_done(self, rec: Record) -> None:
        if self._profiling is rec and not rec.backward_started:
            self._profiling = None  # its graph was dropped without a backward: profile again
        plan, prof = self.plan, self.profile
        if plan is not None and prof is not None and not rec.profiling:
            w = rec.bytes_written / rec.write_s if rec.bytes_written >= 32 << 20 and rec.write_s > 0 else None
            planned = plan.write_bandwidth / 0.9
            if w is not None and abs(w / planned - 1) > self.config.flow.replan_threshold:
                r = rec.bytes_read / rec.read_s if rec.read_s > 0 else None
                log.info("write bandwidth %.2f GB/s differs from the plan's %.2f GB/s: re-planning",
                         w / 1e9, planned / 1e9)
                self.plan = plan_offload(prof, stall_tolerance=self.config.flow.stall_tolerance,
                                         write_bandwidth=w, read_bandwidth=r, shared_channel=self._shared)
            else:
                self._back_off(rec)
        if (self.profile is not None and not rec.profiling and rec.first_packs
                and abs(rec.first_packs - len(self.profile.tensors)) > 0.1 * rec.first_packs):
            log.info("the forward changed (%d offloadable storages, profile had %d): profiling again",
                     rec.first_packs, len(self.profile.tensors))
            self.plan = None
            self.profile = None

    @property
    def _shared(self) -> bool:
        """Stores and loads share one device (files on a disk): the planner serialises them."""
        return self.config.target == "ssd"

    def _back_off(self, rec: Record) -> None:
        """The backward waited for loads longer than the plan allows: offload less from the next step.

        The profile can overrate the time loads have (its own step was slowed by offloading
        everything); the bytes that arrived late (wait x read bandwidth, at least one storage)
        come off the end of the planned prefix.
        """
        plan, prof = self.plan, self.profile
        assert plan is not None and prof is not None
        tol = self.config.flow.stall_tolerance
        if plan.cutoff == 0 or rec.wait_s <= max(tol * plan.step_time, 1e-3):
            return
        late = rec.wait_s * (rec.bytes_read / rec.read_s if rec.read_s > 0 else plan.read_bandwidth)
        cutoff, cut = plan.cutoff, 0.0
        while cutoff > 0 and (cut < late or cutoff == plan.cutoff):
            cutoff -= 1
            cut += prof.tensors[cutoff].nbytes
        log.info("the backward waited %.1f ms for loads (plan allows %.1f ms): offloading %d instead of %d "
                 "storages", rec.wait_s * 1e3, tol * plan.step_time * 1e3, cutoff, plan.cutoff)
        self.stats.plan_backoffs += 1
        self.plan = dataclasses.replace(plan, cutoff=cutoff, bytes_planned=sum(
            tp.nbytes for tp in prof.tensors[:cutoff]))

    def _maybe_plan(self) -> None:
        rec = self._profiling
        if rec is None or not rec.complete or not rec.backward_started:
            return
        self._profiling = None
        prof = self._build_profile(rec)
        w = r = None
        if self.config.target == "ssd":
            # the profiled step's stores were cut short by forwarding: the disk probe is steadier
            w, r = self.bandwidth.probed(wait=5.0)  # made at construction; waited for once, here
            if w:
                log.info("disk probe: write %.2f GB/s, read %.2f GB/s (profiled step: write %.2f GB/s)",
                         w / 1e9, (r or 0) / 1e9, prof.write_bandwidth / 1e9)
        if not w and prof.write_bandwidth <= 0:
            w, r = self.bandwidth.probed(wait=5.0)  # no store finished in the profiled step: the probe's figure
        if not w and prof.write_bandwidth <= 0 and self._retries < 3:
            # no bandwidth known: no store finished during the profiled step (and no probe): measure again
            self._retries += 1
            log.info("adaptive offload: no store finished in the profiled step; profiling the next one")
            return
        self.profile = prof
        self.plan = plan_offload(prof, stall_tolerance=self.config.flow.stall_tolerance,
                                 shared_channel=self._shared, write_bandwidth=w or None, read_bandwidth=r or None)
        log.info("adaptive offload plan: %d of %d storages (%.2f of %.2f GB), prefetch %d unit(s) ahead; "
                 "planned at write %.2f GB/s, read %.2f GB/s (with a safety margin), predicted stall %.1f ms",
                 self.plan.cutoff, len(prof.tensors), self.plan.bytes_planned / 1e9, self.plan.bytes_total / 1e9,
                 self.plan.prefetch_distance, self.plan.write_bandwidth / 1e9, self.plan.read_bandwidth / 1e9,
                 self.plan.predicted_stall * 1e3)

    def _build_profile(self, rec: Record) -> StepProfile:
        sec = Clock.seconds
        t0 = rec.t0
        segs = []
        for i, s in enumerate(rec.segments):
            start = sec(t0, s.t_start) if s.t_start is not None else 0.0
            if s.t_end is not None:
                end = sec(t0, s.t_end)
            elif i + 1 < len(rec.segments) and rec.segments[i + 1].t_start is not None:
                end = sec(t0, rec.segments[i + 1].t_start)
            else:
                end = sec(t0, rec.t_bwd0) if rec.t_bwd0 is not None else start
            # the backward of the profiled step ran with everything offloaded (slowed by its loads):
            # the planner estimates each segment's backward from its forward time instead
            segs.append(SegmentProfile(s.is_unit, start, end, None))
        tensors = [TensorProfile(si, nb, sec(t0, m)) for si, nb, m in rec.tensors]
        st = self.stats
        w = rec.bytes_written / rec.write_s if rec.write_s > 0 else st.write_bandwidth
        r = rec.bytes_read / rec.read_s if rec.read_s > 0 else st.read_bandwidth
        bwd0 = sec(t0, rec.t_bwd0) if rec.t_bwd0 is not None else (segs[-1].forward_end if segs else 0.0)
        return StepProfile(segs, tensors, bwd0, w, r or w)
