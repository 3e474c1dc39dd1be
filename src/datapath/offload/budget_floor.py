"""Below the memory model's floor: what a `memory_budget` runs where no plan is modelled under it.

The model's lowest plan is not refused on the model's word: it runs, and its measured step decides.
Checkpointing's plan (every block recomputed) is then measured against it, one step each
(`datapath.offload.plan_trials`), because the model can err by plan: it cannot see memory a
recomputed block drops and offloading does not (activations under ``min_bytes``), nor memory a
sharded step never holds (FSDP2's, which it counts).  The faster plan whose step held the budget
becomes the floor's, the one run wherever no plan is modelled to fit.  A floor step over the budget
makes the next drain every store before the next pack; a drained step over the budget too raises
`OffloadConfigError`, naming the lowest peak measured and the plan that reached it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from datapath.offload.budget_planner import BudgetPlan, BudgetProfile, checkpoint_plan, shifted
from datapath.offload.errors import OffloadConfigError
from datapath.offload.plan_trials import Run
from datapath.offload.plan_trials import gb as _gb

log = logging.getLogger("datapath.offload.budget")

FLOOR_DEVICE_SHARE = 0.97  # a plan tried or made at the floor: its unmoved modelled peak's cap (share of the device)


class Floor:
    """The floor's state for one `BudgetPolicy` (see the module docstring)."""

    def __init__(self) -> None:
        self.at = False        # the plan in force is the floor's (the model predicted no fit)
        self.drain = False     # ... and every store is drained before the next pack
        self.runs: list[tuple[int, BudgetPlan | None]] = []  # floor steps over the budget: (peak, plan)
        self.tried = False     # checkpointing's plan was measured against the lowest one
        self.checked = False   # the lowest plan's step was compared with its modelled peak
        self.choice: BudgetPlan | None = None  # the plan measured faster than the lowest, within the budget

    def alternative(self, profile: BudgetProfile, lowest: BudgetPlan, peak: int, budget: int,
                    recomputed: tuple[int, ...], device: int) -> BudgetPlan | None:
        """Checkpointing's plan to measure against ``lowest`` (whose step peaked at ``peak``), modelled on
        ``profile`` moved down by what that step showed the model to overstate; None where its unmoved
        figure exceeds ``FLOOR_DEVICE_SHARE`` of ``device`` bytes (a step that might not fit at all)."""
        self.tried = True
        miss = max(0, lowest.predicted_peak - peak)
        alt = checkpoint_plan(shifted(profile, -miss), budget, recomputed=recomputed)
        if alt.predicted_peak + miss > FLOOR_DEVICE_SHARE * device:
            return None
        return dataclasses.replace(alt, predicted_peak=alt.predicted_peak + miss, infeasible=False)

    def lowered(self, profile: BudgetProfile, lowest: BudgetPlan, peak: int,
                plan_for: Callable[[BudgetProfile], BudgetPlan], device: int) -> tuple[BudgetProfile, int] | None:
        """``lowest``, modelled over the budget, held it at ``peak`` (the model counts memory the step does not
        hold, as under FSDP2): ``profile`` moved down by the difference and that difference, where ``plan_for``
        then finds a plan that fits and whose figure before the move stays under ``FLOOR_DEVICE_SHARE`` of
        ``device`` bytes; else None (the floor stays)."""
        self.checked = True
        miss = lowest.predicted_peak - peak
        moved = shifted(profile, -miss)
        plan = plan_for(moved)
        if plan.infeasible or plan.predicted_peak + miss > FLOOR_DEVICE_SHARE * device:
            return None
        log.info("memory budget: the lowest plan's step peaked %s under the memory model's figure for it; every "
                 "interval of the profile moved down by that", _gb(miss))
        return moved, miss

    def round_closed(self, runs: list[Run], kept: BudgetPlan, limit: float) -> bool:
        """The floor's trial ``runs`` (the lowest plan's first) ended keeping ``kept``; steps over ``limit``
        bytes are remembered for a refusal.  True where the floor's plan is now ``kept``, not the lowest."""
        self.checked = True  # the model's error is the lowest plan's: not moved by another plan's step
        self.runs.extend((pk, pl) for pl, pk, _, _ in runs[1:] if pk > limit)
        if not runs or kept is runs[0][0]:
            return False
        self.choice = kept
        self.drain = False
        return True

    @property
    def min_peak(self) -> float | None:
        """The lowest peak a floor step measured over the budget (None: none did)."""
        return float(min(pk for pk, _ in self.runs)) if self.runs else None

    def refusal(self, budget: int, blocks: int, static_bytes: int, held: int) -> OffloadConfigError:
        """The error for a budget the floor's steps all exceeded: the lowest measured peak, its plan, and the memory
        held before a step (``held``; ``static_bytes`` of it the models' parameters, buffers and gradients)."""
        floor, plan = min(self.runs, key=lambda r: r[0])
        what = "every activation offloaded" if plan is None else (
            f"{_gb(plan.offload_bytes)} offloaded, {len(plan.recompute)} of {blocks} blocks recomputed")
        return OffloadConfigError(
            f"memory_budget={_gb(budget)} cannot be met: the measured minimum for this model and batch is "
            f"{_gb(floor)} (a step with {what}; the lowest plan also ran with every store drained before the next). "
            f"Before a step the device holds {_gb(held)} ({_gb(static_bytes)} of it the model's parameters, buffers "
            f"and gradients; the rest optimizer state and other tensors). Raise the budget to at least "
            f"{_gb(floor * 1.03)}, or lower the batch size.")
