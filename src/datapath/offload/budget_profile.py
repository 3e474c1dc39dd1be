"""The `BudgetProfile` a `memory_budget` policy plans from, read off its profiled steps' records.

The memory comes from the step with everything offloaded (each segment's interval peaks, the saved
storages in order, the tail); the times from the step with every block recomputed and nothing
offloaded, where one ran (each segment's forward compute time without the time it waited for stores,
and the backward's ratio to the forward), else from the memory step itself.

A step in which the host did one-off work holds that work's seconds in its time marks: the GPU
idles between two events while the host compiles (``compile=True`` compiles the blocks in the first
step, and AOTAutograd compiles a backward graph at its first backward) or pins host memory (the
offload store's pinned slabs grow during the first step that stores; cudaHostAlloc of a slab stalls
the launches behind it for tens to hundreds of milliseconds).  `one_off_work` counts both, so that
such a step is profiled again (`BudgetPolicy`).
"""
from __future__ import annotations

from typing import Any

from datapath._runtime.pinned import large_pins
from datapath.offload.budget_planner import BudgetProfile, SegmentCost
from datapath.offload.records import Clock, Record

ONE_OFF_REDOS = 3
"""Profiled or measured steps run again at most this many times because one-off work ran in them (a model that
compiles at every step is planned on what its steps measure)."""


def compiler_work() -> int:
    """How many graphs TorchDynamo, AOTAutograd and Inductor have compiled in this process so far (frames traced
    whole, forward graphs, Inductor graphs compiled or read from its cache): a step that changes it compiled."""
    try:
        from torch._dynamo.utils import counters  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a torch without TorchDynamo compiles nothing
        return 0
    inductor = counters.get("inductor", {})
    return int(counters.get("frames", {}).get("ok", 0) + counters.get("aot_autograd", {}).get("total", 0)
               + inductor.get("fxgraph_cache_miss", 0) + inductor.get("fxgraph_cache_hit", 0))


def one_off_work() -> int:
    """`compiler_work` plus the large pinned allocations made so far (`datapath._runtime.pinned.large_pins`): a step
    that changes it did work later steps do not do."""
    return compiler_work() + large_pins()


def record_peak(rec: Record) -> int:
    """The highest interval peak a profiled record measured (bytes)."""
    peaks = [s.mem_fwd for s in rec.segments] + [s.mem_bwd for s in rec.segments if s.mem_bwd is not None]
    return int(max(peaks + [rec.mem_tail]))


def forward_times(rec: Record, clock: Clock) -> list[float]:
    """Forward compute time of each segment of ``rec`` in seconds (the time it waited for stores left out)."""
    n = len(rec.segments)
    out = []
    for i, s in enumerate(rec.segments):
        if s.t_start is not None and s.t_end is not None:
            t = clock.seconds(s.t_start, s.t_end)
        elif s.t_start is not None and i + 1 < n and rec.segments[i + 1].t_start is not None:
            t = clock.seconds(s.t_start, rec.segments[i + 1].t_start)
        else:
            t = 0.0
        out.append(max(0.0, t - s.wait_s))
    return out


def profile_of(rec: Record, timing: Record | None, clock: Clock, bandwidth: tuple[float, float],
               recomputable: list[int]) -> BudgetProfile:
    """Memory from the everything-offloaded step ``rec``; times from the recompute step ``timing`` (or ``rec``);
    ``bandwidth``: the store's (write, read) bytes/s; ``recomputable``: the blocks the planner may recompute."""
    times = forward_times(rec, clock)
    ratio = 2.0
    if timing is not None and len(timing.segments) == len(rec.segments):
        times = forward_times(timing, clock)
        t_f = sum(times)
        t_b = clock.seconds(timing.t_bwd0, timing.t_end) if timing.t_bwd0 is not None and timing.t_end \
            is not None else 0.0
        recomputed = sum(t for t, s in zip(times, rec.segments) if s.block >= 0)
        if t_f > 0 and t_b > recomputed:
            ratio = min(4.0, max(1.0, (t_b - recomputed) / t_f))
    segs = [SegmentCost(s.is_unit, s.block, t, s.mem_fwd, s.mem_bwd) for s, t in zip(rec.segments, times)]
    storages = [(si, nb) for si, nb, _ in rec.tensors]
    w, r = bandwidth
    return BudgetProfile(segs, storages, rec.mem_tail, dict(rec.block_inputs), w, r, recomputable,
                         backward_ratio=ratio, storage_inputs=list(rec.input_of))


def one_off_during(rec: Record, ranks: Any = None) -> bool:
    """Whether one-off work (compiling, pinning host memory) ran during the profiled or measured step ``rec`` (from
    `Record.one_off_work`, set when it began) on any rank of ``ranks`` (a `RankAgreement`; every rank asks at the
    same step)."""
    if rec.one_off_work is None:
        return False
    done = one_off_work() != rec.one_off_work
    if ranks is not None:
        done = bool(ranks.reduce_max([float(done)])[0])
    return done
