"""``memory_budget=`` in a collective-synchronous job: every rank plans on the same numbers.

Under FSDP, FSDP2, DDP or tensor parallelism a step lasts as long as its slowest rank, and a rank
that measures alone measures the others too (its step times include waits for them inside the
collectives).  Ranks that plan on their own measurements run different plans (one recomputes a
block the other keeps) and decide their trials on different numbers.  `RankAgreement` reduces,
over the ranks of a process group, every measured quantity a `BudgetPolicy` decides on, so that
every rank makes the same decisions from identical inputs:

- the profile, once when it is made (`agree_profile`: `all_gather_object` of the profile, its
  calibration, the attention gains, the device's memory and the store's room for attention
  outputs; merged by `merge_profiles`): each
  interval's bytes and each segment's time take the largest over the ranks, the bandwidths and
  the attention's time gains the smallest (every rank plans for the rank that fares worst);
- whether the store was too small for the profiled step (`agree_room`: one ``all_reduce``);
- each planned step's peak (`launch_max` at the end of its backward, read by `Pending.result` when
  the next forward begins: one ``all_reduce`` of one number per planned step);
- a trial round's step times, when the round closes (`reduce_max`: one ``all_reduce``).

Every rank calls these at the same points of the same steps (lock-step), the same number of times.
The numbers are the host's (`max_memory_allocated`, host clocks), and they travel over a gloo group of
their own: a job on NCCL gets one more group (``new_group(backend="gloo")``, made by every rank at its
first forward), so the agreement shares no communicator and no CUDA stream with the job's own collectives
(DDP's bucket all-reduces, FSDP's all-gathers and reduce-scatters) and cannot reorder them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from datapath.offload.budget_planner import BudgetProfile
from datapath.offload.store_room import StoreRoom

log = logging.getLogger("datapath.offload.budget")


class Pending:
    """An ``all_reduce(MAX)`` launched without waiting (gloo runs it in the background): `result` gives the
    reduced numbers."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work = work        # the work to wait for (None once waited)
        self.tensor = tensor    # the reduced CPU tensor

    def result(self) -> list[float]:
        """The reduced numbers (waits for the reduction)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor.tolist()


class RankAgreement:
    """Reductions over the ranks of ``group`` (a gloo process group; None: the default group, itself gloo) for one
    `BudgetPolicy`."""

    def __init__(self, group: Any, world: int) -> None:
        self.group = group
        self.world = world

    @classmethod
    def resolve(cls, setting: Any) -> RankAgreement | None:
        """The agreement ``setting`` (`FlowOptions.agree_across_ranks`) asks for now: None where it is False,
        where ``torch.distributed`` is not initialised, or where the group has one rank.  Called by every rank at
        the same point (the first forward): on a default group that is not gloo it makes a gloo group of every
        rank, which ``new_group`` requires every rank to call."""
        if setting is False:
            return None
        import torch.distributed as dist  # noqa: PLC0415

        if not (dist.is_available() and dist.is_initialized()):
            return None
        given = None if isinstance(setting, bool) or setting is None else setting
        world = dist.get_world_size(given)
        if world <= 1:
            return None
        backend = str(dist.get_backend(given)).lower()
        group = given
        if backend != "gloo":
            if given is not None:
                from datapath.offload.errors import OffloadConfigError  # noqa: PLC0415
                raise OffloadConfigError(
                    f"agree_across_ranks: the process group's backend is {backend}; pass a gloo group of the same "
                    f"ranks (torch.distributed.new_group(ranks, backend='gloo')): the agreement exchanges a few host "
                    f"numbers and must not share a communicator with the job's own collectives")
            group = dist.new_group(backend="gloo")
        log.info("memory budget: plans agree across %d ranks (over gloo%s): the profile, each planned step's peak "
                 "and each trial's step times are the largest over the ranks", world,
                 "" if group is given else f", a group of its own beside the job's {backend}")
        return cls(group, world)

    # ------------------------------------------------------------ numbers
    def launch_max(self, values: list[float]) -> Pending:
        """Start an ``all_reduce(MAX)`` of ``values`` (float64, on the CPU); the host does not wait for it.

        Cost: one gloo reduction of a few bytes between the ranks' processes (tens of microseconds on one host),
        run by gloo's own thread; `Pending.result` waits for it.  No GPU work, no CUDA synchronisation.
        """
        import torch.distributed as dist  # noqa: PLC0415

        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return Pending(work, t)

    def reduce_max(self, values: list[float]) -> list[float]:
        """The largest of each of ``values`` over the ranks (waits for it)."""
        return self.launch_max(values).result()

    def agree_room(self, room: StoreRoom) -> None:
        """The store was too small for the profiled step on any rank: on every rank (and the most bytes one
        block saved: the largest)."""
        full, most = self.reduce_max([float(room.full), float(room.block_bytes_max)])
        room.full = bool(full)
        room.block_bytes_max = int(most)

    # ------------------------------------------------------------ the profile
    def agree_profile(self, profile: BudgetProfile, calibration: int, attention: dict[int, tuple[int, float]],
                      device_bytes: int, attention_room: int = 0,
                      ) -> tuple[BudgetProfile, int, dict[int, tuple[int, float]], int, int]:
        """Every rank's (profile, calibration, attention gains, device memory, store room for attention outputs)
        merged: `merge_profiles`, the largest calibration, `merge_attention`, the smallest device, the smallest
        room (host budgets differ where they follow each rank's free memory).  One ``all_gather_object`` of the
        pickled payload (the host waits for it), once per profile made."""
        import torch.distributed as dist  # noqa: PLC0415

        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, (profile, int(calibration), dict(attention), int(device_bytes),
                                     int(attention_room)), group=self.group)
        return (merge_profiles([g[0] for g in got]), max(g[1] for g in got), merge_attention([g[2] for g in got]),
                min(g[3] for g in got), min(g[4] for g in got))


def _structure(p: BudgetProfile) -> tuple[Any, ...]:
    """What must match for two profiles to merge interval by interval."""
    return ([(s.is_unit, s.block, s.mem_backward is None) for s in p.segments], [seg for seg, _ in p.storages],
            len(p.storage_inputs), list(p.recomputable), sorted(p.block_inputs))


def merge_profiles(profiles: list[BudgetProfile]) -> BudgetProfile:
    """One profile for every rank: per interval the most bytes, per segment the longest time, the lowest
    bandwidths and the highest backward ratio of ``profiles`` (one per rank, in rank order); a storage that not
    every rank saw as a block's input is counted as none's (its bytes counted as an activation's too).  Profiles whose
    segments or storages differ (different shapes per rank) do not merge interval by interval: the one with the
    highest lowest peak is taken (the first such by rank), on every rank alike."""
    first = profiles[0]
    shape = _structure(first)
    if any(_structure(p) != shape for p in profiles[1:]):
        pick = max(range(len(profiles)), key=lambda i: (profiles[i].min_peak, -i))
        log.warning("memory budget: the ranks' profiled steps differ in their segments or saved storages; every "
                    "rank plans on rank %d's (the highest lowest peak)", pick)
        return profiles[pick]
    segs = [dataclasses.replace(
        s, forward_s=max(p.segments[i].forward_s for p in profiles),
        mem_forward=max(p.segments[i].mem_forward for p in profiles),
        mem_backward=None if s.mem_backward is None else max(int(p.segments[i].mem_backward or 0) for p in profiles))
        for i, s in enumerate(first.segments)]
    storages = [(seg, max(p.storages[j][1] for p in profiles)) for j, (seg, _) in enumerate(first.storages)]
    return dataclasses.replace(
        first, segments=segs, storages=storages, mem_tail=max(p.mem_tail for p in profiles),
        block_inputs={b: max(p.block_inputs[b] for p in profiles) for b in first.block_inputs},
        storage_inputs=[b if all(p.storage_inputs[j] == b for p in profiles) else -1
                        for j, b in enumerate(first.storage_inputs)],
        write_bandwidth=min(p.write_bandwidth for p in profiles),
        read_bandwidth=min(p.read_bandwidth for p in profiles),
        backward_ratio=max(p.backward_ratio for p in profiles))


def merge_attention(gains: list[dict[int, tuple[int, float]]]) -> dict[int, tuple[int, float]]:
    """Per block that every rank measured: the most bytes its attention outputs take, the least time keeping them
    saves."""
    common = set(gains[0]).intersection(*gains[1:]) if gains else set()
    return {b: (max(g[b][0] for g in gains), min(g[b][1] for g in gains)) for b in sorted(common)}
