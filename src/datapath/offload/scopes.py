"""Scope tracking: which forward pass and which part of it a saved tensor belongs to, and when its
backward comes.

Module hooks cut each forward pass (a `Record`; one per micro-batch with
`set_microbatch`) into `Segment` s: each call of a *unit* module opens one, and
the code between units gets its own.  When the backward reaches a unit (a
pre-hook on the grad_fn of the unit's output), the storages of the segments
before it are prefetched, in reverse forward order.  On CUDA the CPU is *paced*:
it runs at most a few units ahead of the GPU, because the allocator counts
memory in CPU order and stores free memory in GPU time.  *Blocks* (the layers of
the model's largest ``ModuleList``) are tracked too: the budget planner recomputes
whole blocks.  Profiling records, per segment, its times and the memory peak of
its forward and backward intervals.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import torch
from torch import nn

from datapath.offload.config import OffloadConfig
from datapath.offload.entry import STORED, Releases
from datapath.offload.memory_meter import MemoryMeter
from datapath.offload.models import AttachedModels
from datapath.offload.policy import Policy
from datapath.offload.records import Clock, Record, Segment
from datapath.offload.stats import OffloadStats
from datapath.offload.transfers import Transfers

log = logging.getLogger("datapath.offload.scopes")


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass (on any thread)."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a module output (tensor, tuple/list, dict, ModelOutput)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


class ScopeTracker:
    """The module hooks, the records and segments they build, pacing and prefetching.

    Built with what it uses: the cache's ``lock`` (every hook takes it), ``config`` (the units kept
    last, pacing), the ``policy`` (told of each record and step, asked how far to pace and prefetch),
    the ``transfers`` (loads to start, queued stores to cancel), the cache's ``stats``, the device
    memory ``meter`` (profiled steps), the ``clock``, the attached ``models`` (parameters that may
    move, CUDA or not) and the ``releases`` of dead handles (drained at each root forward and backward end).
    """

    def __init__(self, lock: threading.RLock, config: OffloadConfig, policy: Policy, transfers: Transfers,
                 stats: OffloadStats, meter: MemoryMeter, clock: Clock, models: AttachedModels,
                 releases: Releases) -> None:
        self.lock = lock
        self.keep_last = config.select.keep_last_modules
        self.pace = config.flow.pace
        self.policy = policy
        self.transfers = transfers
        self.stats = stats
        self.meter = meter
        self.clock = clock
        self.models = models
        self.releases = releases
        self.record: Record | None = None
        self.by_mb: dict[int, Record] = {}
        self.mb: int | None = None
        self.expected_units: int | None = None
        # True while the current record is past the segments its plan offloads from: the pack hook then
        # keeps each saved tensor at once, without its bookkeeping (hundreds of saves per step whose host
        # time otherwise starves the GPU of a compiled model's fast blocks)
        self.quiet = False
        self._rids = iter(range(1, 1 << 62))

    # ------------------------------------------------------------- attaching
    def attach(self, model: nn.Module, unit_list: list[nn.Module], blocks: list[nn.Module]) -> list[Any]:
        names = {id(m): n for n, m in model.named_modules()}
        # the hooks run eagerly under torch.compile (a graph break at each unit): they take locks,
        # record events and wait, and keep the scopes of a compiled model as those of an eager one
        eager = torch.compiler.disable
        hooks = [model.register_forward_pre_hook(eager(self._on_root_forward)),
                 model.register_forward_hook(eager(self._on_root_exit))]
        for u in unit_list:
            name = names.get(id(u), u.__class__.__name__)
            hooks.append(u.register_forward_pre_hook(eager(functools.partial(self._on_unit_enter, name))))
            hooks.append(u.register_forward_hook(eager(functools.partial(self._on_unit_exit, name))))
        for i, b in enumerate(blocks):
            # a block that is a unit too (units="blocks"): entered before its unit segment opens and left after
            # it closes, so the unit's segment (and the storages saved in it) belong to the block
            hooks.append(b.register_forward_pre_hook(eager(functools.partial(self._on_block_enter, i)),
                                                     prepend=True))
            hooks.append(b.register_forward_hook(eager(functools.partial(self._on_block_exit, i))))
        return hooks

    # ---------------------------------------------------------------- records
    def start_record(self, microbatch: int | None = None) -> Record:
        self.drop_idle(self.record)
        rec = Record(next(self._rids), False, microbatch if microbatch is not None else self.mb,
                     self.expected_units)
        self.policy.on_record_start(rec)
        self.quiet = False
        rec.pace = self._pace_lead(rec)
        if rec.profiling or rec.timing:
            rec.t0 = self.clock.mark()
        if rec.microbatch is not None:
            self.by_mb[rec.microbatch] = rec
        self.record = rec
        self.stats.records += 1
        return rec

    def _pace_lead(self, rec: Record) -> int:
        """How many units the CPU may run ahead of the GPU during ``rec`` (-1: not paced)."""
        pace = self.pace
        if not (pace is not False and torch.cuda.is_available() and bool(self.models.models)
                and self.models.cuda_model() and self.policy.paces(rec)):
            return -1
        return 1 if isinstance(pace, bool) else int(pace)

    def set_microbatch(self, index: int) -> None:
        """The next forward (or backward) is for micro-batch ``index`` (lock held)."""
        self.mb = index
        rec = self.by_mb.get(index)
        if rec is None or rec.complete:
            rec = self.start_record(microbatch=index)
        self.record = rec

    def drop_idle(self, rec: Record | None) -> None:
        """Forget a record that saved nothing offloadable (no-grad forward) so it cannot block profiling."""
        if rec is not None and rec.first_packs == 0 and not rec.backward_started:
            self.policy.on_record_dropped(rec)
            if rec.microbatch is not None and self.by_mb.get(rec.microbatch) is rec:
                del self.by_mb[rec.microbatch]

    def current(self) -> Record:
        """The record packs go to now (a new one after a backward began)."""
        rec = self.record
        if rec is None or rec.backward_started:
            rec = self.start_record()
        return rec

    def current_segment(self, rec: Record) -> Segment:
        """The segment packs go to now.  Every unit call is followed by a segment for the code after it
        (empty or not), so segment indices are the same in every forward of the same model."""
        if rec.depth == 0 and (not rec.segments or rec.segments[-1].is_unit):
            self._new_segment(rec, False, "(between units)")
        return rec.segments[-1]

    def _new_segment(self, rec: Record, is_unit: bool, name: str) -> Segment:
        self._close_segment(rec)
        seg = Segment(len(rec.segments), is_unit, rec.units, rec.block, name)
        self.quiet = seg.index >= rec.quiet_from
        if rec.timing or rec.profiling:
            seg.t_start = self.clock.mark()
        if rec.profiling:
            self._memory_lap(rec)
            seg.alloc_fwd = self.meter.allocated()
            rec.mem_open = ["fwd", seg]
        rec.segments.append(seg)
        return seg

    def _close_segment(self, rec: Record) -> None:
        if rec.segments and not rec.segments[-1].is_unit and (rec.profiling or rec.timing) \
                and rec.segments[-1].t_end is None:
            rec.segments[-1].t_end = self.clock.mark()

    def _memory_lap(self, rec: Record) -> None:
        """Profiling: the memory peak since the previous boundary goes to the interval it closes."""
        rec.close_lap(self.meter.lap())

    def begin_backward(self, rec: Record) -> None:
        rec.backward_started = True
        self.quiet = False  # what is saved from now on goes through the full path (a new forward: a new record)
        if rec.profiling or rec.timing:
            rec.t_bwd0 = self.clock.mark()
            self._close_segment(rec)
        self.expected_units = rec.units
        keep_last = self.keep_last
        if rec.cutoff is None and rec.plan is None and rec.expected_units is None:
            # the first forward did not know which units are last: drop their queued stores now
            for seg in rec.segments:
                if seg.unit_pos > rec.units - keep_last:
                    for e in seg.entries:
                        if e.state == "pending":
                            self.transfers.forward_pending(e)
        if rec.segments:
            self.prefetch_range(rec, len(rec.segments) - 1)

    def watch_backward_end(self, rec: Record) -> None:
        """Inside the backward of ``rec``: have `policy.on_backward_end` run when the backward finishes
        (the step's memory peak is read there, before anything outside the step resets the counters)."""
        if rec.end_queued or not in_backward():
            return
        rec.end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._on_backward_end, rec))

    def _on_backward_end(self, rec: Record) -> None:
        self.releases.drain()  # the handles the backward let go of (record_done before on_backward_end)
        with self.lock:
            self.policy.on_backward_end(rec)

    def record_done(self, rec: Record) -> None:
        rec.complete = True
        if rec.microbatch is not None and self.by_mb.get(rec.microbatch) is rec:
            del self.by_mb[rec.microbatch]
        self.policy.on_record_done(rec)

    # ------------------------------------------------------------ hooks
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        self.releases.drain()
        with self.lock:
            self.transfers.raise_pending()
            self.models.params_may_have_moved()
            self.policy.on_step_start()
            rec = self.record
            if rec is None or rec.microbatch is None or rec.segments or rec.backward_started:
                rec = self.start_record()
            self.current_segment(rec)  # the code before the first unit: always segment 0

    def _on_root_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """Pacing: what follows the forward (loss, the first backward ops) is launched once the GPU has
        finished the forward, so its memory is counted after the stores made during the forward."""
        if in_backward():
            return
        ev = None
        with self.lock:
            rec = self.record
            if rec is None or rec.backward_started:
                return
            if rec.profiling or rec.timing:
                self._close_segment(rec)
            if rec.profiling:
                self._memory_lap(rec)
                rec.mem_open = ["tail", None]
            if rec.pace >= 0 and rec.live:
                ev = torch.cuda.Event()
                ev.record()
        if ev is not None:
            ev.synchronize()

    def _on_block_enter(self, index: int, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        with self.lock:
            rec = self.current()
            rec.block = index
            self._block_changed(rec)
            if rec.profiling and args and isinstance(args[0], torch.Tensor):
                st = args[0].untyped_storage()
                rec.block_inputs[index] = st.nbytes()
                rec.input_ptrs[st.data_ptr()] = index

    def _on_block_exit(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        with self.lock:
            rec = self.record
            if rec is not None and rec.block == index:
                rec.block = -1
                self._block_changed(rec)

    def _block_changed(self, rec: Record) -> None:
        """Code between units belongs to one block or none: a between-units segment never spans two."""
        if rec.depth == 0 and rec.segments and not rec.segments[-1].is_unit \
                and rec.segments[-1].block != rec.block:
            self._new_segment(rec, False, "(between units)")

    def _on_unit_enter(self, name: str, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        wait_ev = None
        with self.lock:
            rec = self.current()
            rec.depth += 1
            if rec.depth == 1:
                rec.units += 1
                self._new_segment(rec, True, name)
                if rec.pace >= 0:
                    ev = torch.cuda.Event()
                    ev.record()
                    rec.pace_fwd.append(ev)
                    lead = self.policy.forward_lead(rec, rec.segments[-1].index, rec.pace)
                    while len(rec.pace_fwd) > lead:  # lead 0: the event just recorded
                        wait_ev = rec.pace_fwd.popleft()
        if wait_ev is not None:
            t0 = time.perf_counter()
            wait_ev.synchronize()
            rec.segments[-1].pace_wait_s += time.perf_counter() - t0

    def _on_unit_exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        with self.lock:
            rec = self.record
            if rec is None or rec.depth == 0:
                return
            rec.depth -= 1
            if rec.depth:
                return
            seg = rec.segments[-1]
            if rec.profiling or rec.timing:
                seg.t_end = self.clock.mark()
            seen: set[int] = set()
            for t in tensors_in(output):
                fn = t.grad_fn
                if fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(functools.partial(self._on_unit_backward, rec, seg.index))
            self._new_segment(rec, False, "(between units)")

    def _on_unit_backward(self, rec: Record, j: int, grad_outputs: Any) -> None:
        wait_ev = None
        with self.lock:
            seg = rec.segments[j]
            if seg.bwd_fired:
                return
            seg.bwd_fired = True
            if rec.pace >= 0:
                ev = torch.cuda.Event()
                ev.record()
                # the first backward unit waits for the whole forward (the memory peak forms here);
                # later ones for the GPU to reach the backward of the unit ``lead`` units before
                first = not rec.bwd_paced
                rec.bwd_paced = True
                rec.pace_bwd.append(ev)
                if first:
                    wait_ev = ev
                while len(rec.pace_bwd) > rec.pace:  # lead 0: the event just recorded
                    wait_ev = rec.pace_bwd.popleft()
        if wait_ev is not None:
            wait_ev.synchronize()
        with self.lock:
            self.watch_backward_end(rec)
            if rec.profiling:
                seg.t_bwd = self.clock.mark()
                self._memory_lap(rec)
                seg.alloc_bwd = self.meter.allocated()
                rec.mem_open = ["bwd", seg]
            if not rec.backward_started:
                self.begin_backward(rec)
            for e in seg.entries:
                if e.state == "pending":
                    self.transfers.forward_pending(e)
            self.prefetch_range(rec, j)

    # ------------------------------------------------------------ prefetching
    def prefetch_range(self, rec: Record, j: int) -> None:
        """Prefetch segment ``j`` and those before it, down to the ``distance``-th unit before ``j``
        (only while the loads started here stay within the prefetch bound)."""
        if rec.entries_made == 0:  # nothing of this forward was offloaded: nothing to load
            return
        d = rec.distance
        units_before = [i for i in range(j - 1, -1, -1) if rec.segments[i].is_unit]
        lo = units_before[d - 1] if len(units_before) >= d else 0
        limit = self.policy.prefetch_bound(rec)
        started = 0
        for s in range(j, lo - 1, -1):
            if s != j:
                need = sum(e.nbytes for e in rec.segments[s].entries if e.state == STORED and not e.released)
                if started + need > limit:
                    break
            started += self._prefetch_segment(rec, s)

    def _prefetch_segment(self, rec: Record, s: int) -> int:
        """Start bringing back the storages of segment ``s``; the bytes of the loads started."""
        seg = rec.segments[s]
        if seg.prefetched:
            return 0
        seg.prefetched = True
        live = [e for e in seg.entries if not e.released]
        if not live:
            return 0
        self.stats.prefetch_order.append((rec.rid, s))
        started = 0
        for e in live:
            if e.state == STORED:
                started += e.nbytes
            self.transfers.bring_back(e, prefetch=True)
        return started
