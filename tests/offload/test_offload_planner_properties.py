"""Properties of the budget planner on random profiles (units of random sizes and times, storages of every size,
block inputs, bandwidths from 100 kB/s to 50 GB/s): what every plan it returns must satisfy, whatever the model."""
from __future__ import annotations

import dataclasses
import random

import pytest

from datapath.offload import BudgetProfile, SegmentCost, checkpoint_plan, plan_budget, recompute_plan


def _random_profile(rng: random.Random) -> BudgetProfile:
    """1-7 blocks of 1-3 units, each unit saving 0-3 storages (one may be the block's input) and the code after it
    sometimes one more; memory grows with what is saved; a tail peak after the forward."""
    layers = rng.randint(1, 7)
    base = rng.randint(10_000, 1_000_000)
    segs = [SegmentCost(False, -1, rng.uniform(0, 0.002), base, None)]
    storages: list[tuple[int, int]] = []
    inputs: list[int] = []
    mem = base
    for b in range(layers):
        for u in range(rng.randint(1, 3)):
            peak = mem + rng.randint(0, 200_000)
            segs.append(SegmentCost(True, b, rng.uniform(0.0005, 0.02), peak, peak + rng.randint(0, 300_000)))
            for k in range(rng.randint(0, 3)):
                nb = rng.choice([1, 1000, 50_000, 400_000, 3_000_000])
                storages.append((len(segs) - 1, nb))
                inputs.append(b if u == 0 and k == 0 and rng.random() < 0.5 else -1)
                mem += nb
            segs.append(SegmentCost(False, b, rng.uniform(0, 0.003), mem + rng.randint(0, 50_000), None))
            if rng.random() < 0.4:
                nb = rng.choice([1000, 80_000, 700_000])
                storages.append((len(segs) - 1, nb))
                inputs.append(-1)
                mem += nb
    segs.append(SegmentCost(False, -1, rng.uniform(0, 0.004), mem + rng.randint(0, 500_000), None))
    bw = rng.choice([1e5, 1e7, 1e9, 5e10])
    return BudgetProfile(segs, storages, mem + rng.randint(0, 500_000),
                         {b: rng.choice([1000, 50_000, 200_000]) for b in range(layers)}, bw,
                         bw * rng.uniform(0.5, 2), recomputable=list(range(layers)),
                         backward_ratio=rng.uniform(1.5, 2.5), storage_inputs=inputs)


def _not_slower(t: float, than: float) -> bool:
    return t <= than * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_plans_fit_their_budget_and_more_memory_or_bandwidth_never_costs_time(seed: int) -> None:
    rng = random.Random(seed)
    for case in range(100):
        p = _random_profile(rng)
        floor = plan_budget(p, 0).predicted_peak  # the lowest modelled peak of any plan
        top = max(floor + 1, plan_budget(p, 10 ** 12).predicted_peak)
        budgets = sorted(rng.randint(int(floor * 0.8), int(top * 1.1)) for _ in range(6))
        plans = [plan_budget(p, b) for b in budgets]
        for b, plan in zip(budgets, plans):
            where = (seed, case, b)
            # feasible exactly from the floor up, and a feasible plan's modelled peak fits the budget
            assert plan.infeasible == (b < floor), where
            assert plan.infeasible or plan.predicted_peak <= b, where
            ckpt = checkpoint_plan(p, b)
            assert ckpt.recompute == tuple(sorted(p.recomputable))
            if not plan.infeasible:  # the plan for the search's recompute set: the same offloaded prefix and peak
                same = recompute_plan(p, b, plan.recompute)
                assert same.recompute == plan.recompute and not same.infeasible, where
                assert (same.cut_segment, same.cut_bytes, same.offload_bytes, same.predicted_peak) == \
                    (plan.cut_segment, plan.cut_bytes, plan.offload_bytes, plan.predicted_peak), where
            some = set(rng.sample(list(p.recomputable), rng.randint(0, len(p.recomputable))))
            mine = recompute_plan(p, b, some)
            assert mine.recompute == tuple(sorted(some)), where
            assert mine.infeasible or mine.predicted_peak <= b, where
            if mine.infeasible:  # nothing offloaded then, and the peak kept everything over the budget
                assert mine.offload_bytes == 0 and mine.predicted_peak > b, where
            else:  # a higher budget never needs more offloaded for the same recomputation
                assert recompute_plan(p, 2 * b, some).offload_bytes <= mine.offload_bytes, where
            if not ckpt.infeasible:  # checkpointing's plan is one the search weighs: never faster than its pick
                assert ckpt.predicted_peak <= b and not plan.infeasible, where
                assert _not_slower(plan.predicted_time, ckpt.predicted_time), where
        feasible = [(b, plan) for b, plan in zip(budgets, plans) if not plan.infeasible]
        for (b1, p1), (b2, p2) in zip(feasible, feasible[1:]):
            assert _not_slower(p2.predicted_time, p1.predicted_time), (seed, case, b1, b2)
        if feasible:
            b, plan = feasible[0]
            faster = dataclasses.replace(p, write_bandwidth=4 * p.write_bandwidth, read_bandwidth=4 * p.read_bandwidth)
            quick = plan_budget(faster, b)
            assert not quick.infeasible and _not_slower(quick.predicted_time, plan.predicted_time), (seed, case, b)
