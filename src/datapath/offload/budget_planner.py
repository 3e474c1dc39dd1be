"""The memory-budget planner: per saved storage and per block, keep, offload or recompute.

Input: a `BudgetProfile` of one step run with everything offloaded (the lowest
memory the offloader reaches), which gives, per forward *segment* (a unit call or
the code between units), its compute time and the memory peak of its forward
interval; per unit, the memory peak of its backward interval; the memory peak
between the forward's end and the first unit's backward (the loss); every
offloadable storage (its segment and size); the blocks (layers) and the size of
each block's input; the measured store and load bandwidth.

Memory model.  The intervals of a step, in the order the allocator sees them, are
the forward segments 0..n-1, the tail T, then the backward intervals of the units
from the last to the first.  A storage of segment ``s`` is needed again in the
backward interval of the first unit at or after ``s`` (its *own* interval); a kept
storage adds its bytes to every interval strictly between its forward segment and
its own interval, an offloaded one adds nothing there (the profile already holds
what is in flight), and a recomputed block's storages vanish from those intervals
while its input (held by the checkpoint) is kept.  These intervals are one
contiguous range of positions, so a plan's peak is one prefix sum.

Time model.  Compute from the profile's segment times (waits for stores removed),
backward = ``backward_ratio`` x forward.  Offloaded bytes go to the store in forward
order at the write bandwidth; the forward ends when its compute is done and the
bytes still unstored fit the budget's slack.  Loads run in reverse order at the
read bandwidth and delay the backward where they arrive late; bandwidths are
taken at 0.6 of those measured and a step that offloads pays `PACING_COST` (its
transfers compete with the step, its CPU is paced to the GPU), so offloading is
chosen where it hides behind compute, recomputing elsewhere.  A recomputed block
costs its forward time again in the backward.  The model misses what offloading
costs beyond its transfers (host work the pacing exposes on a model of short blocks,
copies competing with the step's kernels): ``offload_cost`` weighs offloading more,
and the budget policy measures such plans against the first (`BudgetPolicy`).

Attention kept.  A recomputed block may keep its attention outputs
(`datapath.offload.attention_saved`): given their measured bytes and forward time per
block (``attention``), those bytes are resident like the block's input (from its
forward to its backward) and its recompute costs that much less time.  For each
candidate plan the most such blocks that still fit the budget are chosen, the last
ones first (their bytes are freed first in the backward).

Attention offloaded.  Where the device has no room for them, the outputs of more
recomputed blocks may wait in the store (`datapath.offload.attention_offload`), given
``attention_room`` store bytes beside what the plan offloads: their bytes leave the
device, one block's outputs are in flight through the whole backward (the next block's,
fetched ahead), and each saves its attention time less its load at the read bandwidth.

Search.  For each number ``m`` of recomputed blocks, two placements (identical
layers being equally good per byte, only where they run matters): the last ``m``
recomputable blocks, so that the first ones, kept, have the most time to store; and
the first ``m``, so that the blocks kept are the last ones, whose activations the
backward frees first, before what it allocates as it goes (parameter gradients;
FSDP's reduced shards) has grown: near checkpointing's peak, which the end of the
backward sets, only they fit without offloading.  For each, the shortest offloaded
prefix of the rest that fits the budget (binary search: memory falls as the prefix
grows); the fastest plan wins, the one offloading fewer bytes on a tie.  None fits:
`infeasible` is set and ``min_peak`` is the lowest peak the profile allows.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SegmentCost:
    """One forward segment of the profiled step."""

    is_unit: bool
    block: int               # enclosing block, -1 outside every block
    forward_s: float         # compute time of its forward (store waits removed)
    mem_forward: int         # memory peak of its forward interval (bytes)
    mem_backward: int | None = None  # units: memory peak of their backward interval


@dataclass
class BudgetProfile:
    """What the profiled step measured (see the module docstring)."""

    segments: list[SegmentCost]
    storages: list[tuple[int, int]]      # (segment, nbytes), in the order they were first saved
    mem_tail: int                        # memory peak from the forward's end to the first unit's backward
    block_inputs: dict[int, int]         # block -> bytes of its input's storage
    write_bandwidth: float               # bytes/s
    read_bandwidth: float                # bytes/s
    recomputable: list[int] = field(default_factory=list)  # blocks the planner may recompute
    backward_ratio: float = 2.0
    storage_inputs: list[int] = field(default_factory=list)  # per storage: the block it is the input of, or -1

    @property
    def min_peak(self) -> int:
        """The highest interval peak of the profiled step: the lowest peak with everything offloaded."""
        peaks = [s.mem_forward for s in self.segments] + [self.mem_tail]
        peaks += [s.mem_backward for s in self.segments if s.mem_backward is not None]
        return max(peaks) if peaks else 0


@dataclass(frozen=True)
class BudgetPlan:
    """Offload the storages of segments before ``cut_segment`` and ``cut_bytes`` of that segment's;
    recompute the blocks in ``recompute``; keep the rest."""

    cut_segment: int
    cut_bytes: int
    recompute: tuple[int, ...]
    offload_bytes: int
    predicted_peak: int
    predicted_time: float
    budget: int
    infeasible: bool = False
    min_peak: int = 0
    attention_saved: tuple[int, ...] = ()   # recomputed blocks that keep their attention outputs
    attention_offloaded: tuple[int, ...] = ()  # ... that keep them in the store
    partitioned: tuple[int, ...] = ()  # recomputed compiled blocks whose compiled region's partitioner recomputes

    def offloads(self, segment: int, done_in_segment: int) -> bool:
        """Whether a storage of ``segment`` is offloaded, ``done_in_segment`` bytes of it being offloaded already."""
        return segment < self.cut_segment or (segment == self.cut_segment and done_in_segment < self.cut_bytes)

    @property
    def storeless(self) -> bool:
        """The plan offloads nothing (it keeps and recomputes only)."""
        return self.offload_bytes == 0 and self.cut_segment == 0 and self.cut_bytes == 0 \
            and not self.attention_offloaded

    def as_dict(self) -> dict[str, object]:
        return {"cut_segment": self.cut_segment, "cut_bytes": self.cut_bytes, "recompute": list(self.recompute),
                "offload_bytes": self.offload_bytes, "predicted_peak": self.predicted_peak,
                "predicted_time": self.predicted_time, "budget": self.budget, "infeasible": self.infeasible,
                "min_peak": self.min_peak, "attention_saved": list(self.attention_saved),
                "attention_offloaded": list(self.attention_offloaded), "partitioned": list(self.partitioned)}


KEEP_ALL = BudgetPlan(0, 0, (), 0, 0, 0.0, 0)  # offloads nothing, recomputes nothing


PACING_COST = 0.03  # a step that offloads paces the CPU to the GPU: this share of its compute time


class _Model:
    """Precomputed positions and costs of one profile."""

    def __init__(self, p: BudgetProfile) -> None:
        self.p = p
        n = len(p.segments)
        self.n = n
        units = [i for i, s in enumerate(p.segments) if s.is_unit]
        own: list[int | None] = [None] * n  # first unit at or after each segment
        nxt: int | None = None
        for i in range(n - 1, -1, -1):
            if p.segments[i].is_unit:
                nxt = i
            own[i] = nxt
        self.own = own
        # positions: forward segments 0..n-1, tail n, backward of unit u at 2n - u
        self.mem: list[float] = [-math.inf] * (2 * n + 1)
        for i, s in enumerate(p.segments):
            self.mem[i] = s.mem_forward
            if s.is_unit and s.mem_backward is not None:
                self.mem[2 * n - i] = s.mem_backward
        self.mem[n] = p.mem_tail
        self.units = units
        self.first_seg: dict[int, int] = {}
        self.last_unit: dict[int, int] = {}
        for i, s in enumerate(p.segments):
            if s.block >= 0:
                self.first_seg.setdefault(s.block, i)
                if s.is_unit:
                    self.last_unit[s.block] = i

    def middle(self, seg: int) -> tuple[int, int]:
        """Positions [lo, hi] where a kept storage of ``seg`` adds its bytes."""
        u = self.own[seg]
        return seg + 1, (2 * self.n - u - 1) if u is not None else self.n - 1

    def peak(self, resident: list[tuple[int, int, int]]) -> float:
        """Highest interval memory with each (lo, hi, bytes) of ``resident`` held over positions lo..hi."""
        diff = [0] * (2 * self.n + 2)
        for lo, hi, nb in resident:
            if lo <= hi:
                diff[lo] += nb
                diff[hi + 1] -= nb
        best = -math.inf
        run = 0
        for pos in range(2 * self.n + 1):
            run += diff[pos]
            m = self.mem[pos]
            if m != -math.inf and m + run > best:
                best = m + run
        return best


def _kept(model: _Model, recompute: set[int], k: int, saved: dict[int, int] | None = None,
          ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """(resident ranges, offloaded storages) when the first ``k`` eligible storages are offloaded; the blocks
    of ``saved`` (block -> bytes) keep their attention outputs from their forward to their backward.

    A kept storage is resident between its save and its use (`_Model.middle`).  A recomputed
    block's storages are not saved, but its backward recomputes them all at once: each is
    resident from the backward of the block's last unit up to its own backward interval, which
    the profile measured with it loaded back already (so a block that is one unit adds nothing).
    """
    p = model.p
    n = model.n
    res: list[tuple[int, int, int]] = []
    off: list[tuple[int, int]] = []
    i = 0
    for j, (seg, nb) in enumerate(p.storages):
        b = p.segments[seg].block
        if b in recompute:
            if j < len(p.storage_inputs) and p.storage_inputs[j] == b:
                continue  # the block's input: held by the checkpoint, counted below
            own = model.own[seg]
            last = model.last_unit.get(b)
            if own is not None and last is not None:
                res.append((2 * n - last, 2 * n - own - 1, nb))
            continue
        if i < k:
            off.append((seg, nb))
        else:
            lo, hi = model.middle(seg)
            res.append((lo, hi, nb))
        i += 1
    for b in recompute:  # the checkpoint holds the block's input
        if b in model.first_seg and b in p.block_inputs:
            lo, hi = model.middle(model.first_seg[b])
            res.append((lo, hi, p.block_inputs[b]))
    for b, nb in (saved or {}).items():
        if b in model.first_seg:
            lo, hi = model.middle(model.first_seg[b])
            res.append((lo, hi, nb))
    return res, off


def _fewest_offloaded(model: _Model, recompute: set[int], n_elig: int, budget: float) -> int:
    """The fewest of the ``n_elig`` eligible storages offloaded (a prefix) whose modelled peak fits ``budget`` with
    the blocks ``recompute`` recomputed (binary search: memory falls as the prefix grows); ``n_elig`` where none."""
    lo, hi = 0, n_elig
    while lo < hi:
        mid = (lo + hi) // 2
        if model.peak(_kept(model, recompute, mid)[0]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _recompute_sets(order: list[int]) -> list[set[int]]:
    """The recompute sets the search tries (the module docstring): none, then for each count ``m`` the last ``m``
    blocks of ``order`` and (where that differs) the first ``m``."""
    sets: list[set[int]] = [set()]
    for m in range(1, len(order) + 1):
        sets.append(set(order[len(order) - m:]))
        if m < len(order):
            sets.append(set(order[:m]))
    return sets


def _eligible(p: BudgetProfile, recompute: set[int]) -> int:
    return sum(1 for seg, _ in p.storages if p.segments[seg].block not in recompute)


def _time(model: _Model, recompute: set[int], off: list[tuple[int, int]], slack: float,
          pacing_cost: float = PACING_COST) -> float:
    """Estimated step time (see the module docstring)."""
    p = model.p
    w, r = max(p.write_bandwidth, 1.0), max(p.read_bandwidth, 1.0)
    segs = p.segments
    start = [0.0] * len(segs)
    t = 0.0
    for i, s in enumerate(segs):
        start[i] = t
        t += s.forward_s
    t_fwd = t
    queue = 0.0
    for seg, nb in off:  # stores in forward order, each from the end of its segment
        queue = max(queue, start[seg] + segs[seg].forward_s) + nb / w
    fwd_end = max(t_fwd, queue - slack / w)
    bwd = [s.forward_s * p.backward_ratio + (s.forward_s if s.block in recompute else 0.0) for s in segs]
    by_seg: dict[int, int] = {}
    for seg, nb in off:
        by_seg[seg] = by_seg.get(seg, 0) + nb
    t_load = fwd_end
    stall = 0.0
    elapsed = 0.0  # backward compute done before segment s begins
    for s in range(len(segs) - 1, -1, -1):
        need = fwd_end + elapsed + stall
        if s in by_seg:
            t_load = max(t_load, fwd_end) + by_seg[s] / r
            if t_load > need:
                stall += t_load - need
        elapsed += bwd[s]
    pacing = pacing_cost * (t_fwd + elapsed) if off else 0.0
    return fwd_end + elapsed + stall + pacing




def modelled_peak(profile: BudgetProfile, recompute: tuple[int, ...] | list[int] = (), offloaded: int = 0,
                  saved: dict[int, int] | None = None) -> float:
    """The peak the memory model gives when the blocks ``recompute`` are recomputed and the first
    ``offloaded`` eligible storages offloaded (the rest kept); ``saved``: block -> attention bytes it keeps."""
    model = _Model(profile)
    return model.peak(_kept(model, set(recompute), offloaded, saved)[0])


def _keep_attention(model: _Model, rec: set[int], k: int, budget: int, attention: dict[int, tuple[int, float]],
                    recomputed: set[int]) -> tuple[dict[int, int], float]:
    """The most recomputed blocks of ``rec`` and ``recomputed`` (those the profile ran recomputed; last first,
    each saving time) whose attention outputs fit ``budget`` with the blocks ``rec`` recomputed and ``k``
    storages offloaded: (block -> bytes, seconds saved)."""
    cands = sorted((b for b in rec | recomputed if b in attention and attention[b][1] > 0), reverse=True)
    lo, hi = 0, len(cands)
    while lo < hi:  # the largest count that fits (memory grows with it)
        mid = (lo + hi + 1) // 2
        if model.peak(_kept(model, rec, k, {b: attention[b][0] for b in cands[:mid]})[0]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    chosen = cands[:lo]
    return {b: attention[b][0] for b in chosen}, sum(attention[b][1] for b in chosen)


def _offload_attention(model: _Model, rec: set[int], k: int, budget: int, attention: dict[int, tuple[int, float]],
                       recomputed: set[int], saved: dict[int, int], room: int, read_bandwidth: float,
                       ) -> tuple[dict[int, int], float]:
    """The recomputed blocks (last first, not in ``saved``) whose attention outputs fit ``room`` store bytes and
    save time net of their load at ``read_bandwidth``, where one block's outputs in flight through the backward
    (the prefetch) still fit ``budget``: (block -> bytes, seconds saved)."""
    def net(b: int) -> float:
        return attention[b][1] - attention[b][0] / read_bandwidth
    cands = sorted((b for b in rec | recomputed if b in attention and b not in saved and net(b) > 0), reverse=True)
    chosen: dict[int, int] = {}
    for b in cands:
        if sum(chosen.values()) + attention[b][0] <= room:
            chosen[b] = attention[b][0]
    if not chosen:
        return {}, 0.0
    window = (model.n, 2 * model.n, max(chosen.values()))
    if model.peak(_kept(model, rec, k, saved)[0] + [window]) > budget:
        return {}, 0.0
    return chosen, sum(net(b) for b in chosen)


def shifted(profile: BudgetProfile, delta: int) -> BudgetProfile:
    """``profile`` with every interval peak moved by ``delta`` bytes (the memory held before a step changed
    since the profiled one: optimizer state made, workspaces, other tensors of the program)."""
    if not delta:
        return profile
    segs = [dataclasses.replace(s, mem_forward=s.mem_forward + delta,
                                mem_backward=None if s.mem_backward is None else s.mem_backward + delta)
            for s in profile.segments]
    return dataclasses.replace(profile, segments=segs, mem_tail=profile.mem_tail + delta)


def plan_budget(profile: BudgetProfile, budget: int, *, safety: float = 0.6,
                offload_cost: float = 1.0, attention: dict[int, tuple[int, float]] | None = None,
                recomputed: tuple[int, ...] | list[int] = (), attention_room: int = 0) -> BudgetPlan:
    """The fastest plan whose modelled peak fits ``budget`` bytes (see the module docstring).

    ``offload_cost`` multiplies what offloading costs in the time model (its transfer times and
    its pacing share): above 1 the planner recomputes more and offloads less (a large value: the
    plan that offloads the fewest bytes, recomputing wherever that fits the budget); the budget
    policy tries such plans against the first one and keeps the fastest measured.

    ``attention``: block -> (bytes, seconds) of keeping its attention outputs when recomputed (measured:
    `datapath.offload.attention_saved.AttentionCosts.gains`); ``recomputed``: blocks the profile ran recomputed
    (every plan recomputes them; they may keep their attention outputs too); ``attention_room``: store bytes
    beside the plan's offloaded ones that attention outputs may take (0: none offloaded).
    """
    if not offload_cost > 0:
        raise ValueError(f"offload_cost must be > 0, got {offload_cost!r}")
    p = profile
    model = _Model(p)

    def timed(cost: float) -> _Model:  # the time model with offloading's transfers weighed ``cost`` times
        return _Model(dataclasses.replace(p, write_bandwidth=p.write_bandwidth * safety / cost,
                                          read_bandwidth=p.read_bandwidth * safety / cost))
    tmodel = timed(offload_cost)
    best: tuple[float, int, int, set[int], float, dict[int, int], dict[int, int], float] | None = None
    always = set(recomputed)
    lowest = math.inf
    lowest_plan: tuple[int, set[int]] = (0, set())
    for rec in _recompute_sets(list(p.recomputable)):
        n_elig = _eligible(p, rec)
        floor = model.peak(_kept(model, rec, n_elig)[0])
        if floor < lowest:
            lowest, lowest_plan = floor, (n_elig, rec)
        if floor > budget:
            continue
        lo = _fewest_offloaded(model, rec, n_elig, budget)
        saved: dict[int, int] = {}
        moved: dict[int, int] = {}
        gain = 0.0
        if attention:
            saved, gain = _keep_attention(model, rec, lo, budget, attention, always)
            if attention_room > 0:  # offloaded beside those kept, or instead of keeping any (the prefetch fits)
                room_left = attention_room - sum(nb for _, nb in _kept(model, rec, lo)[1])
                bw = max(p.read_bandwidth * safety, 1.0)
                options = [(saved, gain, *_offload_attention(model, rec, lo, budget, attention, always, saved,
                                                             room_left, bw))]
                if saved:
                    options.append(({}, 0.0, *_offload_attention(model, rec, lo, budget, attention, always, {},
                                                                 room_left, bw)))
                saved, gain_kept, moved, gain_moved = max(options, key=lambda o: o[1] + o[3])
                gain = gain_kept + gain_moved
        kept, off = _kept(model, rec, lo, saved)
        peak = model.peak(kept)
        if moved:
            peak = max(peak, model.peak(kept + [(model.n, 2 * model.n, max(moved.values()))]))
        lowest = min(lowest, model.peak(_kept(model, rec, lo)[0]))
        # the blocks every plan recomputes (``recomputed``) cost their forward again too
        t = _time(tmodel, rec | always, off, max(0.0, budget - peak), PACING_COST * offload_cost) - gain
        key = (t, sum(nb for _, nb in off))
        if best is None or key < (best[0], best[2]):
            best = (t, lo, sum(nb for _, nb in off), rec, peak, saved, moved, gain)
    if best is None:  # the fastest plan with the lowest modelled peak, marked infeasible
        floor_plan = plan_budget(profile, math.ceil(lowest), safety=safety, offload_cost=offload_cost,
                                 attention=attention, recomputed=recomputed,
                                 attention_room=attention_room) if budget < lowest < math.inf else None
        if floor_plan is not None and not floor_plan.infeasible:  # several plans may reach the floor
            return dataclasses.replace(floor_plan, budget=budget, infeasible=True,
                                       min_peak=int(min(lowest, p.min_peak)))
        k, rec = lowest_plan
        cut_segment, cut_bytes = _cut(p, rec, k)
        off = _kept(model, rec, k)[1]
        return BudgetPlan(cut_segment, cut_bytes, tuple(sorted(rec)), sum(nb for _, nb in off), int(lowest),
                          math.inf, budget, infeasible=True, min_peak=int(min(lowest, p.min_peak)))
    t, k, nbytes, rec, peak, saved, moved, gain = best
    cut_segment, cut_bytes = _cut(p, rec, k)
    if offload_cost != 1.0:  # the time the plain model gives this plan (comparable with other plans')
        t = _time(timed(1.0), rec | always, _kept(model, rec, k)[1], max(0.0, budget - peak)) - gain
    return BudgetPlan(cut_segment, cut_bytes, tuple(sorted(rec)), nbytes, int(peak), t, budget,
                      min_peak=int(min(lowest, p.min_peak)), attention_saved=tuple(sorted(saved)),
                      attention_offloaded=tuple(sorted(moved)))


def offload_all_plan(profile: BudgetProfile, plan: BudgetPlan, attention_saved: tuple[int, ...],
                     attention_bytes: int) -> BudgetPlan:
    """``plan``'s recomputation with every storage offloaded, and the blocks ``attention_saved`` keeping their
    attention outputs as saved tensors of their own (compiled blocks: `datapath.offload.regional_compile`), which
    go to the store too; ``attention_bytes``: what those outputs are estimated to take in all.

    Its modelled peak is the lower of the model's with every eligible storage offloaded and ``plan``'s (offloading
    more only takes memory away), plus one block's attention outputs in flight; its time is not modelled
    (``plan``'s is kept): a trial measures it (`datapath.offload.plan_trials`).
    """
    rec = set(plan.recompute)
    model = _Model(profile)
    peak = min(model.peak(_kept(model, rec, _eligible(profile, rec))[0]), plan.predicted_peak)
    if attention_saved:
        peak += attention_bytes // len(attention_saved)
    stored = sum(nb for _, nb in profile.storages) + attention_bytes
    return BudgetPlan(len(profile.segments), 0, plan.recompute, stored, int(peak), plan.predicted_time,
                      plan.budget, min_peak=plan.min_peak, attention_saved=tuple(sorted(attention_saved)))


def checkpoint_plan(profile: BudgetProfile, budget: int, *, safety: float = 0.6,
                    recomputed: tuple[int, ...] | list[int] = ()) -> BudgetPlan:
    """Checkpointing's plan: every block recomputed, the fewest storages outside them offloaded that fit
    ``budget`` by the model (none where no number fits: `infeasible` set, nothing offloaded).

    The budget policy measures it against a plan the model preferred (`datapath.offload.plan_trials`): a plan
    that keeps or offloads more is kept only where its step is faster, and below the model's floor the
    step decides what the model cannot (a memory model that overstates a sharded step's peak)."""
    return recompute_plan(profile, budget, set(profile.recomputable) | set(recomputed), safety=safety)


def recompute_plan(profile: BudgetProfile, budget: int, recompute: set[int] | tuple[int, ...],
                   *, safety: float = 0.6) -> BudgetPlan:
    """The plan recomputing the blocks ``recompute`` and keeping the other blocks, with the fewest storages
    outside them offloaded that fit ``budget`` by the model (none where no number fits: `infeasible` set,
    nothing offloaded)."""
    p = profile
    model = _Model(p)
    rec = set(recompute)
    lo = _fewest_offloaded(model, rec, _eligible(p, rec), budget)
    infeasible = model.peak(_kept(model, rec, lo)[0]) > budget
    k = 0 if infeasible else lo
    kept, off = _kept(model, rec, k)
    peak = model.peak(kept)
    cut_segment, cut_bytes = _cut(p, rec, k)
    tmodel = _Model(dataclasses.replace(p, write_bandwidth=p.write_bandwidth * safety,
                                        read_bandwidth=p.read_bandwidth * safety))
    t = _time(tmodel, rec, off, max(0.0, budget - peak))
    return BudgetPlan(cut_segment, cut_bytes, tuple(sorted(rec)), sum(nb for _, nb in off), int(peak), t, budget,
                      infeasible=infeasible, min_peak=int(p.min_peak))


def _cut(p: BudgetProfile, recompute: set[int], k: int) -> tuple[int, int]:
    """The first ``k`` eligible storages as (segment before which all go, bytes of that segment that go)."""
    if k == 0:
        return 0, 0
    i = 0
    last_seg, in_seg = 0, 0
    for seg, nb in p.storages:
        if p.segments[seg].block in recompute:
            continue
        if i == k:
            break
        if seg != last_seg:
            last_seg, in_seg = seg, 0
        in_seg += nb
        i += 1
    return last_seg, in_seg
