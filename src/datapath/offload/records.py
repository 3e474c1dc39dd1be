"""What a forward pass saved, cut at module boundaries: a `Record` per forward (micro-batch), a `Segment` per unit
call or code between units, and the `Clock` that times them.

These are plain data: the scope tracker (`datapath.offload.scopes`) fills them from module hooks, the
saved-tensor hooks add the storages they offload, the policies plan on them, and transfers add the
bytes and seconds of each storage's store and load to the record it was saved in.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from datapath.offload.entry import Entry


class Segment:
    """A unit call, or the code between units, in one forward pass."""

    __slots__ = ("index", "is_unit", "unit_pos", "block", "name", "entries", "t_start", "t_end", "t_bwd",
                 "bwd_fired", "prefetched", "wait_s", "pace_wait_s", "mem_fwd", "mem_bwd", "alloc_fwd", "alloc_bwd",
                 "offloaded_bytes")

    def __init__(self, index: int, is_unit: bool, unit_pos: int, block: int, name: str) -> None:
        self.index = index
        self.is_unit = is_unit
        self.unit_pos = unit_pos
        self.block = block          # index of the enclosing block, -1 outside every block
        self.name = name
        self.entries: list[Entry] = []
        self.t_start: Any = None
        self.t_end: Any = None
        self.t_bwd: Any = None
        self.bwd_fired = False
        self.prefetched = False
        self.wait_s = 0.0           # time packs of this segment waited for stores (backpressure)
        self.pace_wait_s = 0.0      # time the CPU waited at this unit's start for the GPU to catch up (pacing):
        # the GPU was busy then, so unlike ``wait_s`` it is no gap in the segment's GPU time
        self.mem_fwd = 0            # profiling: memory peak of its forward interval
        self.mem_bwd: int | None = None  # profiling (units): peak from its backward start to the next unit's
        self.alloc_fwd = 0          # profiling: memory held when its forward began
        self.alloc_bwd = 0          # profiling (units): memory held when its backward began
        self.offloaded_bytes = 0    # bytes of this segment chosen for offloading so far


class Record:
    """The saved tensors of one forward pass (one micro-batch)."""

    def __init__(self, rid: int, profiling: bool, microbatch: int | None, expected_units: int | None) -> None:
        self.rid = rid
        self.profiling = profiling       # memory laps and time marks at every boundary
        self.timing = False              # time marks only (the budget's compute-time profile)
        self.one_off_work: int | None = None  # profiled, timing, trial steps: `one_off_work()` when it began
        self.microbatch = microbatch
        self.expected_units = expected_units
        self.cutoff: int | None = None   # adaptive plan: offload the first ``cutoff`` storages
        self.distance = 1                # prefetch distance in units
        self.plan: Any = None            # budget plan in force for this record
        self.segments: list[Segment] = []
        self.units = 0
        self.depth = 0
        self.block = -1
        self.first_packs = 0
        self.quiet_from = 1 << 62        # from this segment on, the policy keeps every storage (see `quiet`)
        self.live = 0
        self.entries_made = 0
        self.backward_started = False
        self.complete = False
        self.t0: Any = None
        self.t_bwd0: Any = None
        self.t_end: Any = None     # timing: when the backward ended
        self.tensors: list[tuple[int, int, Any]] = []  # profiling: (segment, nbytes, ready mark)
        self.block_inputs: dict[int, int] = {}         # profiling: block -> bytes of its input's storage
        self.input_ptrs: dict[int, int] = {}           # profiling: storage address of a block's input -> block
        self.input_of: list[int] = []                  # profiling: per tensor, the block it is the input of (-1)
        self.mem_tail = 0                              # profiling: peak from the forward's end to the first unit backward
        self.mem_open: list[Any] = []                  # profiling: the interval a memory lap closes
        self.mem_base = 0                              # profiling: memory held when the forward began
        self.pace = -1
        self.pace_fwd: collections.deque[Any] = collections.deque()
        self.pace_bwd: collections.deque[Any] = collections.deque()
        self.bwd_paced = False
        self.end_queued = False    # a callback runs at the end of this record's backward
        self.bwd_done = False      # the backward finished (profiling: and its last interval is measured)
        self.bytes_written = 0
        self.write_s = 0.0
        self.bytes_read = 0
        self.read_s = 0.0
        self.wait_s = 0.0  # time autograd waited in unpack for this record's loads

    def close_lap(self, peak: int) -> None:
        """Profiling: give ``peak`` (a memory lap) to the interval that is open now."""
        if not self.mem_open:
            return
        kind, seg = self.mem_open
        if kind == "fwd":
            seg.mem_fwd = max(seg.mem_fwd, peak)
        elif kind == "tail":
            self.mem_tail = max(self.mem_tail, peak)
        else:
            seg.mem_bwd = max(seg.mem_bwd or 0, peak)


class Clock:
    """Time marks of records and segments: CUDA events on a CUDA model (GPU time), else the host clock.

    ``on_cuda``: whether the attached model runs on CUDA (asked at each mark without a device).
    """

    def __init__(self, on_cuda: Callable[[], bool]) -> None:
        self.on_cuda = on_cuda

    def mark(self, device: torch.device | None = None) -> Any:
        """A time mark now: a recorded CUDA event, or ``time.perf_counter()``."""
        if (device is None and torch.cuda.is_available() and self.on_cuda()) or (
                device is not None and device.type == "cuda"):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (0 when one is a CPU mark and the other a GPU one)."""
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        if isinstance(a, float) or isinstance(b, float):
            return 0.0  # a CPU mark and a GPU mark do not compare
        b.synchronize()
        return a.elapsed_time(b) / 1e3
