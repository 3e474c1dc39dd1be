"""``memory_budget=``: fit a step's peak memory in a budget, as fast as this machine allows.

The first forward pass runs with everything offloaded (the lowest memory the
offloader reaches), profiled for memory (interval peaks in the allocator's own
counters).  The next runs with nothing offloaded and every block recomputed,
profiled for time (each segment's compute time without offloading's stalls, each
block's recompute cost; about checkpointing's memory) -- only where the memory
profile says that step fits the budget; otherwise the plan is made from the first
step's times.  From the two (`BudgetProfile`, moved by the change of the memory held
before a step since the profiled one), `plan_budget` chooses, per saved storage and
per block, keep, offload or recompute.  So the third step (the second, without the
timing profile) runs planned.  The profiled step begins once the store's bandwidth
probe has ended (the probe's device buffers, freed during the step, would otherwise
count in the memory held before it, and every interval measured after their release
would be moved down by their size).  The timing step is a step the memory model knows
too (every block recomputed, nothing offloaded): where its measured peak is above the
model's figure for it (memory the model cannot see, such as tensors a checkpoint holds
beside a block's input), every interval of the profile is moved up by the difference
(`BudgetPolicy.calibration`), so that the first planned step holds the budget rather
than the second.  Where no plan is modelled under the budget and the lowest plan's step
holds it all the same, the profile moves down by what the model overstated (once,
within the device's memory) and the plan is made again.

Where the store cannot hold every activation of the profiled step, the profiled step
recomputes the blocks that would not fit, the next step is profiled with every block
recomputed and every plan recomputes every block (`datapath.offload.store_room`;
`BudgetPolicy.base_recompute`): a budget checkpointing meets is met.  Where the store
holds everything, nothing of this runs.  A planned step then

- offloads the planned prefix of storages, admitting each store only while the
  device's allocated memory stays under the budget minus the forward's measured
  working set (backpressure: the forward waits for stores to drain instead of the
  allocator growing);
- recomputes the planned blocks (non-reentrant checkpointing, RNG replayed);
- loads ahead in the backward only while the memory stays under the budget.

The time model cannot see everything offloading costs, nor what a nearly full device
costs a step that keeps more, so a plan that offloads or recomputes is put to the test
(`datapath.offload.plan_trials`): the plans that offload less, and checkpointing's,
run one step each and the fastest whose peak held the budget is kept
(`BudgetPolicy.trials` says what ran and what was kept).

Each step's measured peak is compared with the budget: above it, the plan is
made again for a budget lowered by the excess (a step whose peak exceeds the
budget corrects the plan for the next); well below it, once, for a budget raised
by part of the gap.  A budget under what the model predicts even with everything
offloaded is not refused on the prediction (`datapath.offload.budget_floor`): the
lowest plan runs, checkpointing's is measured against it, and only a budget every
such step exceeds, the lowest plan's with every store drained before the next too,
raises `OffloadConfigError`, naming the measured minimum and the plan that reached it.

In a job of several ranks (``torch.distributed`` initialised; `FlowOptions.agree_across_ranks`) every
decision reads the largest measures of all the ranks (the profile, each planned step's peak, each trial's
step times: `datapath.offload.rank_agreement`), so every rank runs the same plans.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

from datapath.offload.attention_offload import AttentionStore
from datapath.offload.attention_saved import AttentionCosts
from datapath.offload.bandwidth import StoreBandwidth
from datapath.offload.budget_floor import Floor
from datapath.offload.budget_planner import KEEP_ALL, BudgetPlan, BudgetProfile, modelled_peak
from datapath.offload.budget_planning import LOOKAHEAD, OVER, BudgetPlanning
from datapath.offload import budget_profile
from datapath.offload.budget_profile import ONE_OFF_REDOS, one_off_during, record_peak
from datapath.offload.config import OffloadConfig
from datapath.offload.errors import OffloadConfigError
from datapath.offload.memory_meter import MemoryMeter
from datapath.offload.models import AttachedModels
from datapath.offload.plan_trials import PlanTrials, Run, plan_shape
from datapath.offload.policy import Backpressure, Policy, derived_bound
from datapath.offload.rank_agreement import Pending, RankAgreement
from datapath.offload.recompute import clear_recompute, set_recompute
from datapath.offload.regional_compile import is_compiled
from datapath.offload.records import Clock, Record, Segment
from datapath.offload.stats import OffloadStats
from datapath.offload.store_room import StoreRoom

log = logging.getLogger("datapath.offload.budget")

FREE_LEAD = 16       # units a planned step's CPU may run ahead of the GPU past its offloaded segments
AGREED_TRIAL_STEPS = 2   # steps a trial runs each plan for where the ranks agree (`FlowOptions.trial_steps`)
PROBE_WAIT_S = 30.0       # the longest the profiled step waits for the store's bandwidth probe to end


class BudgetPolicy(BudgetPlanning, Policy):
    """Keep / offload / recompute planned from a profiled step to fit ``budget`` bytes.

    Besides a `Policy`'s collaborators: ``meter``, the device memory the budget is measured
    against; ``models``, the attached models (their blocks are recomputed, their parameters
    count against the budget); ``clock``, the time marks of the steps a trial compares; ``room``,
    the bytes the store may still take (None, or returning None: not known).  Its planning steps (the profile,
    the plans made from it) are `BudgetPlanning`'s (`datapath.offload.budget_planning`).
    """

    name = "budget"

    def __init__(self, config: OffloadConfig, flow: Backpressure, bandwidth: StoreBandwidth, stats: OffloadStats,
                 *, budget: int, meter: MemoryMeter, models: AttachedModels, clock: Clock,
                 room: Callable[[], int | None] | None = None, attention_store: AttentionStore | None = None,
                 ) -> None:
        super().__init__(config, flow, bandwidth, stats)
        self.meter = meter
        self.models = models
        self.clock = clock
        self.budget = int(budget)
        self.target = float(budget)      # the budget the planner aims at (lowered after an overshoot)
        self.keep_target = float(budget)  # ... for plans that store nothing (lowered only by their own overshoot)
        self.plan: BudgetPlan | None = None
        self.profile: BudgetProfile | None = None
        self.last_peak: int | None = None
        self.peaks: list[int] = []
        self.plans_run: dict[tuple, BudgetPlan] = {}  # every plan a step ran, by what it does (`plan_shape`)
        self.replans = 0
        self.planning_s = 0.0                   # host seconds spent in the planner (every plan made so far)
        self.planned_at: int | None = None      # the index of the first step that ran planned
        self._records = 0
        self._profiling: Record | None = None   # the memory profile: everything offloaded
        self._memory: Record | None = None      # ... once measured, until the timing profile is too
        self._timing: Record | None = None      # the time profile: nothing offloaded, every block recomputed
        self._timing_peak: int | None = None    # ... its measured peak (its base: ``mem_base``)
        self.calibration = 0                    # bytes the profile was moved (up: the timing step; down: the floor)
        self._want_timing = False
        self._one_off_redos = 0                 # profiled steps run again because one-off work ran in them
        self._pending_peak: int | None = None
        self._overshot = False
        self._relaxed = False
        self.floor = Floor()      # where no plan is modelled under the budget
        self._head_fwd: list[int] = []
        self._head_bwd = 0
        self._block_bytes: dict[int, int] = {}   # block -> bytes of the storages it saves
        self._error: OffloadConfigError | None = None
        self._trials = PlanTrials(clock)  # its steps a plan are set with the ranks, at the first forward (`_settle`)
        self._last_run: Run | None = None
        self._remeasure = False                 # the last measured step did one-off work: the next runs its plan
        self.room = StoreRoom(room)  # a store too small for the profiled step's activations
        self.profile_peaks: list[int] = []  # the measured peak of each profiled step (memory profiles)
        self.attention = AttentionCosts()   # profiled steps' recomputed blocks: their attention's bytes and time
        self._attention: dict[int, tuple[int, float]] = {}  # ... as the planner takes them
        self.attention_store = attention_store  # where a plan's offloaded attention outputs go (None: kept only)
        self._agreed_room: int | None = None    # ... its room, agreed over the ranks (the smallest)
        # records whose forward ran and whose backward has not ended (micro-batches interleaved by a pipeline
        # schedule): while one waits, the blocks' wrapping must not change (see `_waiting`)
        self._open: list[Record] = []
        # a collective-synchronous job: every rank decides on the largest measures of all (`rank_agreement`)
        self.ranks: RankAgreement | None = None   # resolved when the first forward begins
        self._ranks_set = False
        self._agreeing: list[tuple[Pending, BudgetPlan, tuple[object, object] | None]] = []  # planned steps' peaks
        self._device_bytes: int | None = None      # the smallest device of the ranks (agreed with the profile)

    @property
    def trials(self) -> list[dict[str, object]]:
        """Per trial round: the plans run, their step ms and peaks, and which was kept."""
        return self._trials.rounds

    @property
    def trying(self) -> bool:
        """A trial round is in progress: the next steps run the plans it compares, not the one it will keep."""
        return self._trials.open

    @property
    def store_full(self) -> bool:
        """The profiled step's activations did not all fit the store."""
        return self.room.full

    @property
    def base_recompute(self) -> tuple[int, ...]:
        """The blocks every plan recomputes (the store did not hold the profiled step; else empty)."""
        return self.room.base_recompute

    @property
    def block_bytes_max(self) -> int:
        """The most bytes one block of the first profiled step saved (a store too small)."""
        return self.room.block_bytes_max

    # ------------------------------------------------------------ steps
    def _waiting(self, rec: Record | None = None) -> bool:
        """Whether a micro-batch other than ``rec`` (a record of a pipeline schedule's hints,
        `TensorCache.set_microbatch`) ran its forward and waits for its backward.  A plan switch or a timing step
        re-wraps the blocks (`set_recompute`); a record's backward must see the blocks as its forward did: the
        user's own checkpointing (Hugging Face's, Megatron's) calls a block again in backward, and a block
        wrapped since would save other tensors (`torch.utils.checkpoint.CheckpointError`).  Without hints one
        forward's backward comes before the next forward, and nothing waits."""
        self._open = [r for r in self._open if not (r.bwd_done or r.complete)]
        return any(r is not rec and r.microbatch is not None and r.segments for r in self._open)

    def on_step_start(self) -> None:
        """A forward begins: a new memory lap (the peak is read at the end of the backward), and the
        plan is made or corrected from what the last steps measured (not while an earlier micro-batch waits for
        its backward: the next step's first forward does it)."""
        if self._error is not None:
            raise self._error
        self.meter.lap()
        self._settle()
        if self._waiting():
            return
        rec = self._profiling
        if rec is not None and rec.backward_started and rec.bwd_done:
            self._profiling = None
            self.profile_peaks.append(record_peak(rec))
            if self.ranks is not None:
                self.ranks.agree_room(self.room)
            per_block = self.room.reprofile(rec, self.models.blocks)
            if per_block is not None:  # the next step is profiled again, every block recomputed
                for b, nb in per_block.items():
                    self._block_bytes[b] = self._block_bytes.get(b, 0) + nb
                self.room.block_bytes_max = max(self.room.block_bytes_max,
                                                max(self._block_bytes.values(), default=0))
                return
            self._memory = rec
            self._set_profile(rec, None)
            blocks = self._recomputable(rec)
            # the timing step (every block recomputed, nothing offloaded) runs only where the memory profile
            # says it fits the budget: a budget is often there because more does not fit
            self._want_timing = bool(blocks) and modelled_peak(self.profile, blocks, 0) <= self.target
            if not self._want_timing:
                self._memory = None
                if self._one_off_during(rec):  # its times would time the plans: the next step is profiled again
                    self._redo(rec)
                    return
                self._replan()  # plan on the memory profile's own times
            return
        rec = self._timing
        if rec is not None and rec.backward_started and rec.bwd_done and self._memory is not None:
            self._timing = None
            if self._one_off_during(rec):  # the next step is timed again
                self._redo(rec)
                return
            self._set_profile(self._memory, rec)
            self._memory = None
            self._replan()
            return
        peak, self._pending_peak = self._pending_peak, None
        if peak is None:
            return
        if self._trials.open:
            if self._remeasure:  # the step is run again with the same plan
                self._remeasure = False
                return
            self._round_step()
            return
        self._feedback(peak)
        run = self._last_run
        if run is None or run[0] is not self.plan:
            return
        if self.floor.at and not self.floor.tried:
            # below the model's floor the step decides: checkpointing's plan is measured against the lowest
            assert self.profile is not None
            alt = self.floor.alternative(self.profile, self.plan, peak, self.budget, self.base_recompute,
                                         self._device_total())
            first = None if alt is None else self._trials.start(run, self.plan, [alt])
            if first is not None:
                self._use(first)
            return
        if self._trials.due:
            first = self._trials.start(run, self.plan, self._candidates())
            if first is not None:
                self._use(first)

    def _round_step(self) -> None:
        """A trial round's step ended: its next plan, or the kept one.  At the floor, a kept plan other than
        the lowest becomes the floor's (a replan that finds no fit runs it) and stores are no longer drained."""
        runs = list(self._trials.runs)
        plan = self._trials.step(self.budget, OVER, self.replans)
        if self.floor.at and not self._trials.open and self.floor.round_closed(runs, plan, OVER * self.budget):
            self.target = self.keep_target = float(self.budget)
        self._use(plan)

    def on_backward_end(self, rec: Record) -> None:
        rec.bwd_done = True  # no longer waiting (`_waiting`)
        # a planned step's peak is read, not reset: whoever measures the step after it still sees it
        peak = self.meter.lap() if rec.profiling else self.meter.peak()
        if rec.profiling:
            rec.close_lap(peak)
            rec.mem_open = []
            rec.bwd_done = True
        elif rec.timing:
            rec.t_end = self.clock.mark()
            rec.bwd_done = True
            self._timing_peak = peak
        elif rec.plan is not None:
            if self.planned_at is None:
                self.planned_at = self._records - 1
            self.last_peak = peak  # this rank's (``peaks``); decisions read the ranks' largest (`_measured`)
            self.plans_run.setdefault(plan_shape(rec.plan), rec.plan)
            self.peaks.append(peak)
            marks = None
            if rec.t0 is not None:
                rec.t_end = self.clock.mark()
                marks = (rec.t0, rec.t_end)
                # a trial's step that compiled (a plan's first run of a block's other compiled forward) or
                # pinned holds that work's seconds: not measured, its plan runs again
                self._remeasure = self._one_off_during(rec)
                if self._remeasure:
                    self._redo(rec)
                    marks = None
            if self.ranks is not None:  # read when the next forward begins (`_settle`)
                self._agreeing.append((self.ranks.launch_max([float(peak)]), rec.plan, marks))
            else:
                self._measured(peak, rec.plan, marks)

    def _measured(self, peak: int, plan: BudgetPlan, marks: tuple[object, object] | None) -> None:
        """A planned step of ``plan`` ended at ``peak`` bytes (the ranks' largest where they agree), timed from
        ``marks`` (start, end) where a trial measures it."""
        self._pending_peak = max(peak, self._pending_peak or 0)
        self._last_run = None
        if marks is not None:
            self._last_run = (plan, peak, marks[0], marks[1])
            self._trials.record(self._last_run)

    def _settle(self) -> None:
        """A forward begins: agreement across ranks is set up (first forward), and the peaks of the planned steps
        since the last forward, reduced over the ranks, are taken in (`_measured`)."""
        if not self._ranks_set:
            self._ranks_set = True
            self.ranks = RankAgreement.resolve(self.config.flow.agree_across_ranks)
            if self.ranks is not None:
                self._trials.agree = self.ranks.reduce_max
            steps = self.config.flow.trial_steps
            self._trials.repeat = steps if steps is not None else AGREED_TRIAL_STEPS if self.ranks is not None else 1
        agreeing, self._agreeing = self._agreeing, []
        for pending, plan, marks in agreeing:
            self._measured(int(pending.result()[0]), plan, marks)

    def _one_off_during(self, rec: Record) -> bool:
        """One-off work (compiling, pinning host memory) ran during the profiled or measured step ``rec`` (its
        times hold that work's seconds), and the step may run again."""
        return self._one_off_redos < ONE_OFF_REDOS and one_off_during(rec, self.ranks)

    def _redo(self, rec: Record) -> None:
        """The step ``rec`` (profiled, timing, or a trial's) is run again: its times hold one-off work's seconds
        (the memory it measured would do)."""
        self._one_off_redos += 1
        what = "timing" if rec.timing else "profiled" if rec.profiling else "measured"
        log.info("memory budget: the compiler ran or host memory was pinned during the %s step (its times hold that "
                 "one-off work); the next step is %s again", what, "timed" if rec.timing else what)

    def _refuse(self) -> None:
        clear_recompute(self.models.blocks)
        self.plan = None
        self._error = self.floor.refusal(self.budget, len(self.models.blocks), self.models.static_bytes(),
                                         self.meter.allocated())
        raise self._error

    def on_record_start(self, rec: Record) -> None:
        # planned steps load ahead as far as the budget's memory allows (`prefetch_bound`): the offloaded
        # storages are the first ones, needed last, and their loads overlap the whole backward before them
        rec.distance = self.config.flow.prefetch_distance if self.plan is None else 1 << 30
        rec.plan = self.plan
        if self.plan is not None and not self.floor.drain:
            # the plan offloads a prefix of segments: past it every storage is kept (the pack hook's quick way)
            rec.quiet_from = self.plan.cut_segment + (1 if self.plan.cut_bytes else 0)
        if self.plan is not None and (self._trials.due or self._trials.open or (self.floor.at and not self.floor.tried)):
            rec.t0 = self.clock.mark()  # a step a trial measures
            rec.one_off_work = budget_profile.one_off_work()  # (measured again if it compiles or pins)
        if self.plan is None:
            self.attention.attach(self.models.blocks, skip=is_compiled)  # a profiled step: what keeping attention
            # would cost (compiled blocks are the compiler's)
            if self._memory is None and self._profiling is None:
                rec.profiling = True
                self.room.step_started(self.models.blocks)  # after a store too small: every block recomputed
                # the probe's device buffers are freed when it ends: counted in the memory held before the
                # profiled step, they would be taken off every interval measured after it (see the docstring)
                self.bandwidth.probed(wait=PROBE_WAIT_S)
                rec.mem_base = self.meter.allocated()
                rec.one_off_work = budget_profile.one_off_work()
                self._profiling = rec
            elif self._memory is not None and self._timing is None and self._want_timing and not self._waiting(rec):
                # compute times without offloading's stalls, and each block's recompute cost: one step with
                # every block recomputed and nothing offloaded (about checkpointing's memory)
                rec.timing = True
                rec.plan = KEEP_ALL
                rec.mem_base = self.meter.allocated()
                rec.one_off_work = budget_profile.one_off_work()
                self._timing = rec
                self._timing_peak = None
                set_recompute(self.models.blocks, self._recomputable(self._memory))
        self._records += 1
        self._open.append(rec)

    def on_record_dropped(self, rec: Record) -> None:
        self._open = [r for r in self._open if r is not rec]
        if self._profiling is rec:
            self._profiling = None
        if self._timing is rec:
            self._timing = None

    def on_record_done(self, rec: Record) -> None:
        if self._profiling is rec and not rec.backward_started:
            self._profiling = None
        if self._timing is rec and not rec.backward_started:
            self._timing = None

    # ------------------------------------------------------------ decisions
    def decide(self, rec: Record, seg: Segment, idx: int, nbytes: int) -> bool:
        plan = rec.plan
        if plan is None:
            return super().decide(rec, seg, idx, nbytes)
        return plan.offloads(seg.index, seg.offloaded_bytes)

    def admit(self, rec: Record, nbytes: int) -> float:
        t = self.flow
        if rec.plan is None:  # the memory profile: the lowest memory, two storages in flight
            if rec.profiling:
                self.room.watch(rec, nbytes, self.models.blocks)
            return t.admit(nbytes, 2.0 * self.max_storage_bytes)
        if self.floor.drain:  # the floor: the store of every earlier storage is over before the next is queued
            return t.admit(nbytes, 0.0)
        return self._hold(rec)

    def admit_kept(self, rec: Record, nbytes: int) -> float:
        # a kept storage adds to the memory too: past the offloaded segments, stores still in flight must
        # drain before the memory grows over the budget (the forward waits instead of the allocator growing)
        if rec.plan is None or rec.timing or self.flow.inflight_bytes == 0:
            return 0.0
        return self._hold(rec)

    def _hold(self, rec: Record) -> float:
        """Wait while the device holds more than the budget minus the working set of the next segments."""
        s = rec.segments[-1].index if rec.segments else 0
        heads = self._head_fwd
        mark = self.target - (heads[s] if s < len(heads) else max(heads, default=0))
        meter = self.meter
        if meter.allocated() <= mark:
            return 0.0
        # the device holds more than the budget allows here: wait for stores to free memory
        return self.flow.admit_until(lambda: meter.allocated() <= mark)

    def prefetch_bound(self, rec: Record) -> float:
        if rec.plan is None:
            return derived_bound(self.max_storage_bytes, self.bandwidth.now()[1])
        # room for the largest working set still to come in this backward, and for a recomputed block's
        # activations, which all come back at once when its backward starts
        plan = rec.plan
        again = max((self._block_bytes.get(b, 0) for b in plan.recompute), default=0)
        return max(0.0, self.target - self._head_bwd - again - self.meter.allocated())

    def paces(self, rec: Record) -> bool:
        return not rec.timing and (rec.plan is None or rec.plan.offload_bytes > 0)

    def stores_nothing(self, rec: Record) -> bool:
        plan = rec.plan
        return (plan is not None and not rec.profiling and not rec.timing and not self.floor.drain
                and plan.offload_bytes == 0 and plan.cut_segment == 0 and plan.cut_bytes == 0)

    def forward_lead(self, rec: Record, segment: int, lead: int) -> int:
        plan = rec.plan
        if plan is None:
            return super().forward_lead(rec, segment, lead)
        # a planned step stores only its first segments: pace while their stores run, then let the CPU run
        # ahead (a wait per unit starves the GPU where a unit's kernels are shorter than their launches)
        return lead if segment <= plan.cut_segment + LOOKAHEAD else max(lead, FREE_LEAD)

    def close(self) -> None:
        """Wait for the rank agreements in flight (every rank launched them: decide nothing); take the attention
        probes and the planned recomputation off the blocks.  A failed agreement is logged, not raised: nothing
        waits for its answer, and a closing context may be carrying the error that ended a rank's step."""
        agreeing, self._agreeing = self._agreeing, []
        for pending, _, _ in agreeing:
            try:
                pending.result()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.warning("memory budget: a rank agreement failed while closing (%s: %s)", type(exc).__name__, exc)
        self.attention.detach(self.models.blocks)
        clear_recompute(self.models.blocks)

    @property
    def min_peak(self) -> float:
        """The lowest peak known to be reachable: the floor's measured step, else the memory profile's."""
        if self.floor.min_peak is not None:
            return self.floor.min_peak
        return self.profile.min_peak if self.profile is not None else math.nan
