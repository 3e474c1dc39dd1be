"""Putting a `memory_budget` plan to the test: the plans it was preferred to run one step each.

The time model cannot see everything offloading costs (stalls, PCIe shared with the step's own
traffic), nor what a nearly full device costs a step that keeps more, so after a plan that offloads
or recomputes has run one measured step, the plans made with offloading weighed more
(``TRIAL_COSTS``: less offloaded, more recomputed) and checkpointing's plan (every block recomputed)
run one step each, and the fastest measured step (GPU time from the forward's start to the
backward's end) whose peak held the budget is kept.  With ``repeat`` (where the ranks agree, or as
`datapath.offload.config.FlowOptions.trial_steps` sets it) every plan runs that many steps in a row,
its fastest counting.  Below the model's floor, checkpointing's plan is measured against the lowest
plan the same way.  `PlanTrials` holds a trial's state;
`datapath.offload.budget.BudgetPolicy` asks it which plan runs next.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from datapath.offload.budget_planner import BudgetPlan
from datapath.offload.records import Clock

log = logging.getLogger("datapath.offload.budget")

TRIAL_COSTS = (4.0, 1e3)  # offload cost factors of the plans tried against one that offloads (1e3: fewest bytes)
MAX_TRIAL_ROUNDS = 2      # trials per policy (a plan remade after a correction may be tried again)

Run = tuple[BudgetPlan, int, object, object]  # (plan, measured peak bytes, clock mark at start, at end)


def plan_shape(plan: BudgetPlan) -> tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                          tuple[int, ...]]:
    """What a plan does (two plans of one shape run the same step)."""
    return (plan.cut_segment, plan.cut_bytes, plan.recompute, plan.attention_saved, plan.attention_offloaded,
            plan.partitioned)


def gb(n: float) -> str:
    """Bytes for a message: GB with 2 decimals, MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.2f} MB"


def _attention(plan: BudgetPlan) -> str:
    """What a plan does with its recomputed blocks' attention outputs, for a message ("" where nothing)."""
    kept = f", attention kept in {list(plan.attention_saved)}" if plan.attention_saved else ""
    moved = f", attention offloaded in {list(plan.attention_offloaded)}" if plan.attention_offloaded else ""
    return kept + moved + (f", partitioned {list(plan.partitioned)}" if plan.partitioned else "")


class PlanTrials:
    """The trial rounds of one policy: what ran, what was kept (``rounds``), and the round in progress."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.rounds: list[dict[str, object]] = []  # per round: the plans run, their step ms and peaks, kept
        self.due = False                  # the plan in force offloads: its first measured step opens a round
        self.next: list[BudgetPlan] | None = None  # the round's plans still to run (None: no round open)
        self.runs: list[Run] = []         # the round's measured steps
        self.lost: set[tuple] = set()  # shapes (`plan_shape`) a kept plan outran
        # the ranks' longest of each step time (`datapath.offload.rank_agreement`; None: this rank's own)
        self.agree: Callable[[list[float]], list[float]] | None = None
        self.repeat = 1  # measured steps each plan of a round runs, one after another (the fastest counts)

    @property
    def open(self) -> bool:
        """A round is in progress."""
        return self.next is not None

    def record(self, run: Run) -> None:
        """A planned step ended with ``run``: part of the round in progress, if one is."""
        if self.next is not None:
            self.runs.append(run)

    def start(self, run: Run, current: BudgetPlan, candidates: list[BudgetPlan]) -> BudgetPlan | None:
        """Open a round after ``run``, the first measured step of ``current``, against ``candidates``.

        Infeasible candidates and those that run ``current``'s step again are left out.  Returns the
        first plan to run, or None where none is left.
        """
        self.due = False
        seen = {plan_shape(current)}
        todo: list[BudgetPlan] = []
        for p in candidates:
            if not p.infeasible and plan_shape(p) not in seen:
                seen.add(plan_shape(p))
                todo.append(p)
        if not todo:
            return None
        self.runs = [run]
        self.next = [current] * (self.repeat - 1) + [p for p in todo for _ in range(self.repeat)]
        return self.next.pop(0)

    def step(self, budget: int, over: float, replans: int) -> BudgetPlan:
        """A round's step ended: the round's next plan, or (closing it) the fastest measured plan whose peak
        held ``budget`` x ``over`` (the round's first plan where none did)."""
        assert self.next is not None
        if self.next:
            return self.next.pop(0)
        self.next = None
        secs = [self.clock.seconds(t0, t1) for _, _, t0, t1 in self.runs]
        if self.agree is not None:  # one all_reduce per round, when it closes (every rank closes it alike)
            secs = self.agree(secs)
        # per plan, in the order first run: its steps' times and peaks; its fastest step and highest peak decide
        by_plan: dict[tuple, tuple[BudgetPlan, list[float], list[int]]] = {}
        for t, (plan, peak, _, _) in zip(secs, self.runs, strict=True):
            _, times, peaks = by_plan.setdefault(plan_shape(plan), (plan, [], []))
            times.append(t)
            peaks.append(peak)
        runs = [(min(times), max(peaks), plan) for plan, times, peaks in by_plan.values()]
        steps = [times for _, times, _ in by_plan.values()]
        self.runs = []
        held = [r for r in runs if r[1] <= over * budget]
        best = min(held, key=lambda r: r[0]) if held else runs[0]
        if held:
            self.lost.update(plan_shape(p) for _, _, p in runs if p is not best[2])
        self.rounds.append({
            "plans": [dict(p.as_dict(), step_ms=t * 1e3, peak=pk, steps_ms=[x * 1e3 for x in ts])
                      for (t, pk, p), ts in zip(runs, steps, strict=True)],
            "kept": runs.index(best), "replans": replans})
        log.info("memory budget: plans tried %s; kept offload %s, recompute %s%s (%.1f ms)",
                 ", ".join(f"{t * 1e3:.1f} ms ({gb(p.offload_bytes)} offloaded, recompute {list(p.recompute)}"
                           f"{_attention(p)})" for t, _, p in runs),
                 gb(best[2].offload_bytes), list(best[2].recompute), _attention(best[2]), best[0] * 1e3)
        return best[2]
