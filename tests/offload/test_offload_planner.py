"""The adaptive planner on profiles with known answers."""
from __future__ import annotations

import pytest

from datapath.offload.planner import SegmentProfile, StepProfile, TensorProfile, plan_offload, simulate


def _profile(bw_write: float, bw_read: float, units: int = 4, fwd: float = 0.02, layer_bytes: float = 2.1e9,
             measured_backward: bool = True) -> StepProfile:
    """A GPT-like step: ``units`` layers of ``fwd`` seconds saving ``layer_bytes`` in 8 tensors; backward 2x."""
    segs = []
    for u in range(units):
        bwd = units * fwd + 2 * fwd * (units - 1 - u) if measured_backward else None
        segs.append(SegmentProfile(True, u * fwd, (u + 1) * fwd, bwd))
    segs.append(SegmentProfile(False, units * fwd, units * fwd, None))  # the loss
    sizes = [1, 1, 3, 1, 1, 1, 4, 4]
    tensors = [TensorProfile(u, int(layer_bytes * s / 16), u * fwd + (k + 1) * fwd / len(sizes))
               for u in range(units) for k, s in enumerate(sizes)]
    return StepProfile(segs, tensors, units * fwd, bw_write, bw_read)


def test_backward_starts_measured_and_estimated() -> None:
    p = _profile(50e9, 50e9)
    q = _profile(50e9, 50e9, measured_backward=False)
    assert p.backward_starts() == pytest.approx(q.backward_starts())  # the 2x estimate matches here
    assert p.backward_starts()[3] == pytest.approx(0.08)
    assert p.backward_starts()[0] == pytest.approx(0.20)
    assert p.step_time == pytest.approx(0.24)


def test_fast_target_offloads_early_layers_not_the_last() -> None:
    plan = plan_offload(_profile(50e9, 55e9))
    per_layer = 8
    assert per_layer * 2 <= plan.cutoff < per_layer * 4  # the first two layers at least, never the last one
    ok, stall = simulate(_profile(50e9, 55e9), plan.cutoff, plan.prefetch_distance, 45e9, 49.5e9)
    assert ok and stall <= 0.02 * 0.24
    # one more storage would break the rule (a store late, or a stall over the tolerance)
    ok2, stall2 = simulate(_profile(50e9, 55e9), plan.cutoff + 1, plan.prefetch_distance, 45e9, 49.5e9)
    assert not ok2 or stall2 > 0.02 * 0.24


def test_slow_disk_offloads_only_what_its_bandwidth_allows() -> None:
    fast = plan_offload(_profile(50e9, 55e9))
    slow = plan_offload(_profile(2.6e9, 3.0e9))
    assert 0 < slow.bytes_planned < fast.bytes_planned
    assert slow.bytes_planned <= slow.bytes_allowed  # no more than bandwidth x half a step
    assert slow.bytes_planned < 0.1 * slow.bytes_total


def test_disk_shared_by_stores_and_loads_plans_less_and_stays_in_time() -> None:
    prof = _profile(2.6e9, 3.0e9, layer_bytes=0.6e9)
    split = plan_offload(prof)
    shared = plan_offload(prof, shared_channel=True)
    assert 0 < shared.bytes_planned <= split.bytes_planned
    w, r = shared.write_bandwidth, shared.read_bandwidth
    # serialised on one disk: every store, then every load, inside the step without a stall
    ok, stall = simulate(prof, shared.cutoff, shared.prefetch_distance, w, r, shared_channel=True)
    assert ok and stall <= 0.02 * prof.step_time
    assert shared.bytes_planned <= shared.bytes_allowed == pytest.approx(prof.step_time / (1 / w + 1 / r))
    # on a disk the loads are issued as early as possible (from the first backward unit: 4 units ahead),
    # over PCIe as late as the stall tolerance allows (held in memory for the least time)
    assert shared.prefetch_distance == 4
    assert split.prefetch_distance < 4


def test_more_bandwidth_never_offloads_less() -> None:
    got = [plan_offload(_profile(bw, bw)).bytes_planned for bw in (1e9, 3e9, 10e9, 30e9, 100e9, 1e12)]
    assert got == sorted(got)
    assert got[-1] > 0.7 * plan_offload(_profile(1e12, 1e12)).bytes_total


def test_no_bandwidth_measured_offloads_nothing() -> None:
    plan = plan_offload(_profile(0.0, 0.0))
    assert plan.cutoff == 0 and plan.bytes_planned == 0


def test_explicit_bandwidth_overrides_profile() -> None:
    p = _profile(2.6e9, 3.0e9)
    assert plan_offload(p, write_bandwidth=50e9, read_bandwidth=55e9).cutoff == plan_offload(
        _profile(50e9, 55e9)).cutoff
