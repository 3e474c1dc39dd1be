"""`BudgetPolicy`'s planning: the profile made from its profiled steps, and the plans made from it.

`BudgetPlanning`, mixed into `datapath.offload.budget.BudgetPolicy`, holds the policy's side of planning:
`_set_profile` (the memory step's profile, times from the timing step, moved by the memory held since, moved up by
the timing step's calibration, agreed over the ranks; `_build_profile`), `_plan_for` (`plan_budget` for a target,
the blocks the profile was taken with recomputed staying recomputed), `_replan` (the plan for the policy's target
put in force, and logged), `_candidates` (the plans a trial measures against the one in force), `_feedback` (the
target corrected from a planned step's measured peak: lowered past an overshoot, raised once well under the budget,
the profile moved down where the lowest plan held; `_lower_to`), `_use` and `_recomputable`.  The planner itself is
`datapath.offload.budget_planner`.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from datapath.offload.budget_planner import (
    BudgetPlan, BudgetProfile, checkpoint_plan, modelled_peak, offload_all_plan, plan_budget, recompute_plan,
    shifted)
from datapath.offload.budget_profile import profile_of
from datapath.offload.plan_trials import MAX_TRIAL_ROUNDS, TRIAL_COSTS
from datapath.offload.plan_trials import gb as _gb
from datapath.offload.plan_trials import plan_shape as _shape
from datapath.offload.recompute import (
    COMPILED_PARTITIONED, COMPILED_SAVING_ATTENTION, already_recomputed, draws_dropout, set_recompute)
from datapath.offload.memory_meter import CudaMeter
from datapath.offload.records import Record
from datapath.offload.regional_compile import PARTITION_BUDGET

log = logging.getLogger("datapath.offload.budget")  # one logger for the policy and its planning

LOOKAHEAD = 4        # forward segments whose working set a pack's admission leaves room for
STORE_SHARE = 0.9    # the share of the store's room a plan offloading everything may fill
RELAX_BELOW = 0.93   # a planned step under this share of the budget may relax the plan (once)
OVER = 1.005         # a planned step over this share of the budget corrects the plan (measurement noise below)
PARTITION_SHARE = 1.5 * PARTITION_BUDGET  # a partitioned block's saved bytes as a share of a kept block's, assumed
# for the device check (its budget is a share of the memory between the partitioner's least and all)
DEVICE_SHARE = 0.95    # the share of the device a trial's plan whose peak is not modelled may be expected to reach


class BudgetPlanning:
    """The planning steps of a `BudgetPolicy`, mixed into it: they read and set the policy's state, set by its
    ``__init__`` (``profile``, ``plan``, ``target``, ``budget``, ``calibration``, ``replans``, ``planning_s``,
    ``keep_target``, ``ranks``, ``room``, ``floor``, ``attention``, ``attention_store``, ``models``, ``meter``, ``config``,
    ``clock``, ``bandwidth``, ``stats``, ``_overshot``, ``_relaxed``,
    and ``_trials``, ``_attention``, ``_agreed_room``, ``_timing_peak``, ``_head_fwd``, ``_head_bwd``, ``_block_bytes``,
    ``_device_bytes``) and its properties ``base_recompute`` and ``trials``."""

    def _candidates(self) -> list[BudgetPlan]:
        """The plans a trial measures against the one in force: those made with offloading weighed more
        (where it offloads), the plan storing nothing at ``keep_target`` (`_keeping_plan`), checkpointing's
        (every block recomputed) where the plan recomputes other blocks or offloads attention outputs; of the
        plan and checkpointing's, their compiled blocks recomputed keeping their attention outputs
        (`_compiled_attention_plan`); and of those and of every candidate storing nothing, their compiled blocks
        recomputed by their partitioner (`_partitioned_plans`: where the plan in force offloads, a candidate that
        keeps blocks is where the partitioned plans keeping blocks start from)."""
        assert self.plan is not None and self.profile is not None
        plans = [self._plan_for(self.target, cost) for cost in TRIAL_COSTS] if self.plan.offload_bytes else []
        keep = self._keeping_plan()
        if keep is not None:
            plans.append(keep)
        ckpt = checkpoint_plan(self.profile, int(self.target), recomputed=self.base_recompute)
        if ckpt.infeasible and self.keep_target > self.target:  # checkpointing's plan may store nothing
            alt = checkpoint_plan(self.profile, int(self.keep_target), recomputed=self.base_recompute)
            ckpt = alt if alt.storeless else ckpt
        # a plan recomputing every block may still offload attention outputs: the probe measured what their
        # recomputation costs, not what their copies take from the step (kept on the device, they take nothing)
        differs = ckpt.recompute != self.plan.recompute or bool(self.plan.attention_offloaded)
        plans += [ckpt] if differs else []
        compiled = [self._compiled_attention_plan(p) for p in (self.plan, ckpt)]
        storeless = tuple(p for p in plans if p.storeless and not p.infeasible)
        return plans + [p for p in compiled if p is not None] + self._partitioned_plans((self.plan, *storeless, ckpt))

    def _partitioned_plans(self, bases: tuple[BudgetPlan, ...]) -> list[BudgetPlan]:
        """`_partitioned_plan` of each of ``bases`` and of the plans keeping fewer of its kept blocks
        (`_fewer_kept`): a partitioned block saves more than a checkpointed one, so a plan that fills the budget
        with kept blocks overshoots once the rest are partitioned, and one keeping fewer may be the fastest that
        holds it.  The trial measures them all."""
        if not self.config.flow.partition_compiled or not isinstance(self.meter, CudaMeter):
            return []
        assert self.profile is not None
        saved: dict[int, int] = {}  # from the profile, which the ranks agree on (``_block_bytes`` is this rank's)
        for seg, nb in self.profile.storages:
            b = self.profile.segments[seg].block
            saved[b] = saved.get(b, 0) + nb
        out: list[BudgetPlan] = []
        seen: set[tuple] = set()
        for base in bases:
            for plan in (base, *self._fewer_kept(base)):
                split = self._partitioned_plan(plan, saved)
                if split is not None and _shape(split) not in seen:
                    seen.add(_shape(split))
                    out.append(split)
        return out

    def _fewer_kept(self, base: BudgetPlan) -> list[BudgetPlan]:
        """Where ``base`` stores nothing and keeps K > 1 blocks: the plans keeping about two thirds and a third
        of them (of those, the first or the last ones: the lower modelled peak), the rest recomputed, each storing
        nothing at ``base``'s own budget (a plan storing nothing may be planned above a target lowered by an
        overshoot: `_keeping_plan`)."""
        assert self.profile is not None
        if base.infeasible or not base.storeless:
            return []
        always = set(self.profile.recomputable) | set(self.base_recompute)
        kept = sorted(always - set(base.recompute))
        out: list[BudgetPlan] = []
        for k in sorted({-(-2 * len(kept) // 3), -(-len(kept) // 3)} - {0, len(kept)}, reverse=True):
            options = [recompute_plan(self.profile, base.budget, always - set(keep))
                       for keep in (kept[:k], kept[-k:])]
            best = min(options, key=lambda p: (p.infeasible, p.predicted_peak))
            if best.storeless and not best.infeasible:
                out.append(best)
        return out

    def _partitioned_plan(self, base: BudgetPlan, saved: dict[int, int]) -> BudgetPlan | None:
        """Where ``base`` stores nothing and recomputes compiled blocks: the same plan with those blocks recomputed
        by their compiled region's partitioner (`datapath.offload.regional_compile.PARTITION_BUDGET`), which saves
        the outputs that buy back the most recompute time.  What it saves is seen only once compiled, so its peak
        is not modelled: the trial measures it, and a step over the budget loses.  Proposed only where asked for
        (`FlowOptions.partition_compiled`), on a GPU, for blocks without dropout, where the blocks saving
        `PARTITION_SHARE` of the bytes they save when kept (``saved``: block -> bytes), all at once, would still
        fit the device.  `_partitioned_plans` checks that they are asked for."""
        blocks = self.models.blocks
        split = tuple(b for b in base.recompute if b < len(blocks) and COMPILED_PARTITIONED in blocks[b].__dict__
                      and b not in base.attention_saved and not draws_dropout(blocks[b]))
        if base.infeasible or not base.storeless or not split or base.partitioned:
            return None
        extra = PARTITION_SHARE * sum(saved.get(b, 0) for b in split)
        if base.predicted_peak + extra > DEVICE_SHARE * self._device_total():
            return None
        return dataclasses.replace(base, partitioned=split)

    def _compiled_attention_plan(self, base: BudgetPlan) -> BudgetPlan | None:
        """Where ``base`` recomputes compiled blocks: its recomputation with those blocks keeping their attention
        outputs (saved tensors of their compiled region: the attention forward is not run again in the backward)
        and every storage offloaded, if the store has room for it all and the model has it under the target.
        Blocks with dropout are left out: the other compiled graph would draw other masks than the compiled block
        (`datapath.offload.regional_compile`).
        The probe cannot see into a compiled region: each block's attention outputs are taken to be its input's
        size (a decoder's attention output has the hidden size), with a tenth more."""
        assert self.profile is not None
        blocks = self.models.blocks
        compiled = tuple(b for b in base.recompute if b < len(blocks)
                         and COMPILED_SAVING_ATTENTION in blocks[b].__dict__ and not draws_dropout(blocks[b]))
        inputs = self.profile.block_inputs
        if base.infeasible or not compiled or set(compiled) <= set(base.attention_saved) \
                or not all(b in inputs for b in compiled):
            return None
        attention = sum(inputs[b] for b in compiled) * 11 // 10
        plan = offload_all_plan(self.profile, base, compiled, attention)
        if plan.offload_bytes > STORE_SHARE * self._attention_room() or plan.predicted_peak > self.target:
            return None
        return plan

    def _keeping_plan(self) -> BudgetPlan | None:
        """Where a step that stored overshot (``keep_target`` above ``target``): the plan storing the fewest bytes
        at ``keep_target``, if it stores nothing.  A step's peak over its plan's may be its stores in flight (they
        leave the device later than modelled), which a plan that only keeps and recomputes does not have."""
        if self.keep_target <= self.target or self.floor.drain:
            return None
        keep = self._plan_for(self.keep_target, TRIAL_COSTS[-1])
        return keep if keep.storeless and not keep.infeasible else None

    def _use(self, plan: BudgetPlan) -> None:
        self.plan = plan
        self._wrap(plan)

    def _wrap(self, plan: BudgetPlan) -> None:
        """Put ``plan``'s recomputation on the blocks (with its attention outputs kept or offloaded)."""
        set_recompute(self.models.blocks, plan.recompute, plan.attention_saved, plan.attention_offloaded,
                      self.attention_store, plan.partitioned)

    def _attention_room(self) -> int:
        """Store bytes a plan's offloaded attention outputs may take beside its offloaded tensors: the store's
        whole budget (nothing is in flight when a step is planned; over ranks, the smallest), 0 without a host
        store."""
        if self._agreed_room is not None:
            return self._agreed_room
        return self.attention_store.capacity() if self.attention_store is not None else 0

    def _recomputable(self, rec: Record) -> list[int]:
        blocks = self.models.blocks
        return [b for b in sorted({s.block for s in rec.segments if s.block >= 0})
                if b < len(blocks) and not already_recomputed(blocks[b]) and b not in self.base_recompute]

    def _plan_for(self, target: float, offload_cost: float = 1.0, profile: BudgetProfile | None = None,
                  ) -> BudgetPlan:
        """`plan_budget` for ``target`` bytes on ``profile`` (the policy's by default); the blocks the profile was
        taken recomputed stay recomputed."""
        profile = profile or self.profile
        assert profile is not None
        t0 = time.perf_counter()
        plan = plan_budget(profile, int(target), offload_cost=offload_cost, attention=self._attention,
                           recomputed=self.base_recompute, attention_room=self._attention_room())
        self.planning_s += time.perf_counter() - t0
        if self.base_recompute:
            plan = dataclasses.replace(plan, recompute=tuple(sorted(set(plan.recompute) | set(self.base_recompute))))
        return plan

    def _set_profile(self, rec: Record, timing: Record | None) -> None:
        """The profile from the memory record ``rec`` (times from ``timing`` when given), moved by the change
        of the memory held at a step's start since ``rec`` began (optimizer state made after it, ...)."""
        now = self.meter.allocated()
        self._attention = self.attention.gains()
        self.attention.detach(self.models.blocks)
        self.profile = shifted(self._build_profile(rec, timing), now - rec.mem_base)
        if timing is not None and self._timing_peak is not None:
            # the timing step ran a configuration the model knows (every block recomputed, nothing offloaded):
            # its measured peak above the memory it began with, against the model's figure above ``now``
            blocks = self._recomputable(rec)
            miss = (self._timing_peak - timing.mem_base) - (modelled_peak(self.profile, blocks, 0) - now)
            self.calibration = max(0, int(miss))
            if self.calibration:
                self.profile = shifted(self.profile, self.calibration)
        if self.ranks is not None:  # every rank plans on the largest measures (once per profile made)
            self.profile, self.calibration, self._attention, self._device_bytes, self._agreed_room = \
                self.ranks.agree_profile(self.profile, self.calibration, self._attention, self.meter.total(),
                                         self._attention_room())
        if timing is not None and self.calibration:
            log.info("memory budget: the timing step peaked %s above the memory model's figure for it; every "
                     "interval of the profile moved up by that", _gb(self.calibration))
        segs = rec.segments
        # what the forward allocates beyond what it holds at a segment's start, over the next few segments:
        # a pack waits for stores while the device holds more than the budget minus that
        grow = [max(0, s.mem_fwd - s.alloc_fwd) for s in segs]
        self._head_fwd = [max(grow[i: i + LOOKAHEAD]) for i in range(len(grow))]
        self._head_bwd = max((s.mem_bwd - s.alloc_bwd for s in segs if s.mem_bwd is not None), default=0)
        self._block_bytes = {b: self.room.block_bytes_max for b in self.base_recompute}  # measured by the first step
        for si, nb, _ in rec.tensors:
            b = segs[si].block
            if b >= 0:
                self._block_bytes[b] = self._block_bytes.get(b, 0) + nb

    def _replan(self, relaxing: bool = False) -> None:
        """Plan for ``target`` (or, where the model has it faster or nothing fits ``target``, the plan storing
        nothing at ``keep_target``); ``relaxing`` (a higher target): a plan a kept one outran in a trial stays out."""
        assert self.profile is not None
        plan = self._plan_for(self.target)
        aim = self.target
        keep = self._keeping_plan()
        if keep is not None and (plan.infeasible or keep.predicted_time < plan.predicted_time):
            plan, aim = keep, self.keep_target
        if relaxing and _shape(plan) in self._trials.lost:
            return
        self.replans += 1
        self.floor.at = plan.infeasible
        if plan.infeasible:
            # not refused on the model's word: the lowest plan runs, and its measured peak decides
            log.info("memory budget: no plan is modelled under %s (the lowest modelled: %s); running the lowest",
                     _gb(self.target), _gb(plan.predicted_peak))
            plan = self.floor.choice or dataclasses.replace(plan, infeasible=False)
        if self.plan is not None and _shape(plan) == _shape(self.plan):
            return  # the same step as before (a relaxed target that changes nothing): its measures stand
        self.plan = plan
        self._trials.due = (bool(plan.offload_bytes or plan.recompute) and not self.floor.at
                            and len(self.trials) < MAX_TRIAL_ROUNDS)
        self._wrap(plan)
        log.info("memory budget %s (planning for %s): offload %s (%d segments), recompute %d block(s) %s (attention "
                 "kept in %s, offloaded in %s), predicted peak %s, predicted step %.1f ms", _gb(self.budget),
                 _gb(aim), _gb(plan.offload_bytes), plan.cut_segment, len(plan.recompute), list(plan.recompute),
                 list(plan.attention_saved), list(plan.attention_offloaded),
                 _gb(plan.predicted_peak), plan.predicted_time * 1e3)

    def _build_profile(self, rec: Record, timing: Record | None) -> BudgetProfile:
        """Memory from the everything-offloaded step ``rec``; times from the recompute step ``timing``."""
        return profile_of(rec, timing, self.clock, self.bandwidth.now(), self._recomputable(rec))

    def _device_total(self) -> int:
        """The device's memory (the smallest of the ranks' where they agree)."""
        return self._device_bytes if self._device_bytes is not None else self.meter.total()

    def _feedback(self, peak: int) -> None:
        """A planned step peaked at ``peak`` bytes (the ranks' largest): correct the target, or refuse the budget
        where the lowest plan did not hold it even with every store drained."""
        if self.plan is None or self.profile is None:
            return
        if peak > OVER * self.budget:
            self._overshot = True
            self.stats.plan_corrections += 1
            if self.floor.at:
                self.floor.runs.append((peak, self.plan))
                if self.floor.drain:
                    self._refuse()
                # the lowest plan did not hold: drain every store before the next pack, load only on demand
                self.floor.drain = True
                self.target = 0.0
                log.info("memory budget: the lowest plan's step peaked at %s, over the budget %s; draining every "
                         "store before the next pack", _gb(peak), _gb(self.budget))
                return
            self.target -= (peak - self.budget) * 1.1 + 0.002 * self.budget
            if self.plan.storeless:  # else the miss may be stores in flight, which a plan storing nothing lacks
                self.keep_target = min(self.keep_target, self.target)
            log.info("memory budget: the step's peak %s exceeded the budget %s; planning for %s",
                     _gb(peak), _gb(self.budget), _gb(self.target))
            self._replan()
        elif self.floor.at and not self.floor.checked and peak < self.plan.predicted_peak:
            self._lower_to(peak)
        elif (peak < RELAX_BELOW * self.budget and not self._overshot and not self._relaxed
              and self.target < self.budget and (self.plan.offload_bytes or self.plan.recompute)):
            self._relaxed = True
            # aim higher only where the model's own prediction erred on the safe side, never past the budget
            # (the step's peak varies with how fast its stores drain)
            self.target = min(float(self.budget), self.target + 0.5 * (0.985 * self.budget - peak))
            self.keep_target = max(self.keep_target, self.target)
            log.info("memory budget: the step's peak %s is well under the budget %s; planning for %s",
                     _gb(peak), _gb(self.budget), _gb(self.target))
            self._replan(relaxing=True)

    def _lower_to(self, peak: int) -> None:
        """The lowest plan, modelled over the budget, held it at ``peak``: move the profile down (`Floor.lowered`)."""
        assert self.profile is not None and self.plan is not None
        moved = self.floor.lowered(self.profile, self.plan, peak, lambda p: self._plan_for(self.target, profile=p),
                                   self._device_total())
        if moved is not None:
            self.profile, miss = moved
            self.calibration -= miss
            self._replan()
