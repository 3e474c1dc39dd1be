"""memory_budget across data-parallel ranks: every rank plans on the largest measures and runs the same plans."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _offload_models import GPT, assert_identical, cpu_keep_peak
from datapath.apps import init_distributed, launch
from datapath.offload import BudgetProfile, OffloadConfigError, SegmentCost, TensorCache
from datapath.offload.rank_agreement import RankAgreement, merge_attention, merge_profiles

STEPS = 16


def _lm_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(ids).flatten(0, 1), ids.roll(-1, 1).flatten())


def _heavier(nbytes: int, sleep_s: float, device: torch.device) -> Any:
    """A forward pre-hook: the module allocates ``nbytes`` more for a moment and runs ``sleep_s`` longer."""
    def hook(module: nn.Module, args: Any) -> None:
        extra = torch.empty(nbytes, dtype=torch.uint8, device=device)  # counted by the memory meter, then freed
        del extra
        time.sleep(sleep_s)
    return hook


def _math_attention(device: torch.device) -> Any:
    """CUDA: the math attention kernels (deterministic backward); the CPU: nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    return sdpa_kernel(SDPBackend.MATH)


def _keep_peak(model: nn.Module, ids: torch.Tensor) -> int:
    """The peak of one step of a copy of ``model`` with nothing offloaded (bytes)."""
    if ids.device.type == "cpu":
        return cpu_keep_peak(model, _lm_loss, ids)
    m = copy.deepcopy(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with _math_attention(ids.device):
        _lm_loss(m, ids).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _steps(model: nn.Module, batches: list[torch.Tensor], cache: TensorCache | None
           ) -> tuple[list[Any], list[Any]]:
    """Train-like steps: per step (loss, grads), and the plan in force after it (None before the first)."""
    out, plans = [], []
    for i, ids in enumerate(batches):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1000 + i)
        if cache is None:
            with _math_attention(ids.device):
                loss = _lm_loss(model, ids)
                loss.backward()
        else:
            with cache, _math_attention(ids.device):
                loss = _lm_loss(model, ids)
                loss.backward()
            plan = cache.plan
            plans.append(None if plan is None else (plan.cut_segment, plan.cut_bytes, plan.recompute,
                                                    plan.attention_saved))
        out.append((loss.detach().clone(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
    return out, plans


def _worker(agree: Any, device: str = "cpu") -> dict[str, Any]:
    """One rank: DDP over a 4-layer GPT that is, on rank 1, bigger (each block allocates a third of keep's peak
    more for a moment as it begins) and slower (block 2 sleeps); ``STEPS`` steps under a budget at 70% of keep's
    peak, with ``agree_across_ranks=agree``; gradients compared with the same steps without offloading.
    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU a rank, longer sequences)."""
    if device == "cuda":  # deterministic kernels: bit-identical gradients compare the offloading, not the GPU
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    ctx = init_distributed(device)
    dev = ctx.device
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=64, h=64, heads=4, layers=4, dropout=0.0, tied=False).to(dev)
    g = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
    shape = (8, 64) if dev.type == "cpu" else (16, 256)  # on a GPU activations outweigh the parameters
    batches = [torch.randint(0, 64, shape, generator=g).to(dev) for _ in range(STEPS)]
    keep = _keep_peak(model, batches[0])  # the same on every rank (same shapes, no extra yet)
    if ctx.rank == 1:
        for i, blk in enumerate(model.blocks):
            blk.register_forward_pre_hook(_heavier(keep // 3, 0.01 if i == 2 else 0.0, dev))
    ids = [dev.index] if dev.type == "cuda" else None
    ref, _ = _steps(nn.parallel.DistributedDataParallel(copy.deepcopy(model), device_ids=ids), batches, None)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    cache = TensorCache("host", memory_budget=int(keep * 0.7), min_bytes=1024, offload_cpu_tensors=dev.type == "cpu",
                        agree_across_ranks=agree)
    cache.attach(ddp)
    collectives = {"all_reduce": dist.all_reduce, "all_gather_object": dist.all_gather_object}
    if agree is False:  # the policy must call no collective of its own
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a collective was called with agree_across_ranks=False")
        dist.all_reduce = dist.all_gather_object = refuse  # type: ignore[assignment]
    try:
        got, plans = _steps(ddp, batches, cache)
    finally:
        dist.all_reduce, dist.all_gather_object = collectives["all_reduce"], collectives["all_gather_object"]
    assert_identical(ref, got)  # raises in the rank: the launcher reports it
    policy = cache.policy
    res = {"plans": plans, "trials": policy.trials, "profile": policy.profile, "peaks": list(policy.peaks),
           "profile_peaks": list(policy.profile_peaks),
           "agreeing": policy.ranks is not None, "calibration": policy.calibration}
    cache.close()
    return res


@pytest.mark.slow
def test_ranks_run_the_same_plans_on_the_largest_measures() -> None:
    """Rank 1 is bigger and slower: with agreement (the default under torch.distributed) both ranks end with the
    same profile, the same sequence of plans and the same trial rounds (step times and peaks: the largest);
    gradients identical to steps without offloading on each rank."""
    r0, r1 = launch(_worker, 2, (None,))
    assert r0["agreeing"] and r1["agreeing"]
    assert r0["plans"] == r1["plans"] and r0["plans"][-1] is not None
    assert r0["profile"] == r1["profile"] and r0["calibration"] == r1["calibration"]
    assert r0["trials"] == r1["trials"] and r0["trials"], "a trial must run (its step times agreed)"
    assert max(r1["profile_peaks"]) > max(r0["profile_peaks"])  # rank 1 measured more in its profiled step
    larger = {max(a, b) for a, b in zip(r0["peaks"], r1["peaks"], strict=True)}
    for t in r0["trials"]:  # each trial step's peak: the larger of the two ranks' at that step
        assert all(p["peak"] in larger for p in t["plans"])
        assert all(len(p["steps_ms"]) == 2 for p in t["plans"])  # where the ranks agree: two steps a plan


@pytest.mark.slow
def test_without_agreement_the_ranks_plan_apart() -> None:
    """The same job with ``agree_across_ranks=False``: no collective of the policy's, and the ranks plan on their
    own measures (what the agreement prevents); gradients still identical."""
    r0, r1 = launch(_worker, 2, (False,))
    assert not r0["agreeing"] and not r1["agreeing"]
    # each rank plans on its own profile: rank 1's, measured with its extra memory, models a higher floor (with
    # agreement both plan on the larger).  Whether the plans then differ depends on the measured times and peaks
    # of the run (they did in most runs, not all), so the test reads the profiles, not the plans
    assert r1["profile"].min_peak > r0["profile"].min_peak


@pytest.mark.gpu
def test_ranks_agree_on_two_gpus_over_nccl() -> None:
    """The same on two GPUs: the reductions run over NCCL (device tensors, the host waiting only at the next
    forward's start)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    r0, r1 = launch(_worker, 2, (None, "cuda"))
    assert r0["agreeing"] and r1["agreeing"]
    assert r0["plans"] == r1["plans"] and r0["plans"][-1] is not None
    assert r0["profile"] == r1["profile"] and r0["trials"] == r1["trials"]


def _profile(rng: random.Random, n: int = 6, storages: int = 8) -> BudgetProfile:
    segs = [SegmentCost(i % 2 == 1, i // 2 if i < n - 1 else -1, rng.uniform(1e-3, 5e-3), rng.randint(100, 10_000),
                        rng.randint(100, 10_000) if i % 2 == 1 else None) for i in range(n)]
    st = [(rng.randrange(n - 1), rng.randint(1, 5000)) for _ in range(storages)]
    return BudgetProfile(segs, sorted(st), rng.randint(100, 10_000), {b: rng.randint(1, 999) for b in range(2)},
                         rng.uniform(1e9, 2e9), rng.uniform(1e9, 2e9), [0, 1], backward_ratio=rng.uniform(1, 3),
                         storage_inputs=[-1] * storages)


def test_merged_profile_takes_the_worst_of_each_measure() -> None:
    rng = random.Random(5)
    a = _profile(rng)
    b = dataclasses.replace(_profile(rng), segments=[dataclasses.replace(
        s, forward_s=rng.uniform(1e-3, 5e-3), mem_forward=rng.randint(100, 10_000),
        mem_backward=None if s.mem_backward is None else rng.randint(100, 10_000)) for s in a.segments],
        storages=[(seg, rng.randint(1, 5000)) for seg, _ in a.storages])
    m = merge_profiles([a, b])
    for i, s in enumerate(m.segments):
        assert s.forward_s == max(a.segments[i].forward_s, b.segments[i].forward_s)
        assert s.mem_forward == max(a.segments[i].mem_forward, b.segments[i].mem_forward)
        assert s.mem_backward == (None if a.segments[i].mem_backward is None
                                  else max(a.segments[i].mem_backward, b.segments[i].mem_backward))
    assert [nb for _, nb in m.storages] == [max(x[1], y[1]) for x, y in zip(a.storages, b.storages)]
    assert m.mem_tail == max(a.mem_tail, b.mem_tail) and m.min_peak == max(a.min_peak, b.min_peak)
    assert m.block_inputs == {k: max(a.block_inputs[k], b.block_inputs[k]) for k in a.block_inputs}
    assert m.write_bandwidth == min(a.write_bandwidth, b.write_bandwidth)
    assert m.read_bandwidth == min(a.read_bandwidth, b.read_bandwidth)
    assert m.backward_ratio == max(a.backward_ratio, b.backward_ratio)
    assert merge_profiles([b, a]) == m  # the same on every rank, whatever its place
    d = dataclasses.replace(a, storage_inputs=[0] + [-1] * (len(a.storages) - 1))  # one rank saw a block's input
    assert merge_profiles([a, d]).storage_inputs == [-1] * len(a.storages)
    assert merge_profiles([d, d]).storage_inputs == d.storage_inputs
    # segments that differ: no interval-by-interval merge; the profile with the highest lowest peak, on every rank
    c = dataclasses.replace(_profile(rng, n=8), mem_tail=10**6)
    assert merge_profiles([a, c]) is c and merge_profiles([c, a]) is c
    assert merge_attention([{0: (10, 2.0), 1: (5, 1.0)}, {1: (7, 0.5), 2: (1, 1.0)}]) == {1: (7, 0.5)}


def test_one_process_calls_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of one rank (initialised or not) and the option off: no collective, the same plans as before."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no collective may run in a one-rank job")
    monkeypatch.setattr(dist, "all_reduce", refuse)
    monkeypatch.setattr(dist, "all_gather_object", refuse)
    torch.manual_seed(0)
    model = GPT(vocab=64, h=32, heads=4, layers=3, dropout=0.0, tied=False)
    batches = [torch.randint(0, 64, (4, 32)) for _ in range(5)]
    ref, _ = _steps(copy.deepcopy(model), batches, None)
    budget = int(cpu_keep_peak(model, _lm_loss, batches[0]) * 0.6)
    runs = []

    def run(agree: Any) -> None:
        m = copy.deepcopy(model)
        cache = TensorCache("host", memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True,
                            agree_across_ranks=agree)
        cache.attach(m)
        got, plans = _steps(m, batches, cache)
        assert_identical(ref, got)
        assert cache.policy.ranks is None and plans[-1] is not None
        runs.append(cache.policy.profile)
        cache.close()

    run(None)  # torch.distributed not initialised
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for agree in (None, True, False):
            run(agree)
    finally:
        dist.destroy_process_group()
    assert runs[0].segments and [len(p.storages) for p in runs] == [len(runs[0].storages)] * 4


def test_agreement_option_is_checked() -> None:
    with pytest.raises(OffloadConfigError, match="agree_across_ranks"):
        TensorCache("host", memory_budget="1GB", agree_across_ranks="yes")


def _own_gloo_group() -> dict[str, Any]:
    """One rank: the default group reported as NCCL (as a GPU job's is): `RankAgreement.resolve` makes a gloo group
    of every rank for itself and reduces over it; a given group that is not gloo is refused."""
    ctx = init_distributed("cpu")
    real = dist.get_backend
    world = dist.group.WORLD
    dist.get_backend = lambda group=None: "nccl" if group in (None, world) else real(group)  # type: ignore[assignment]
    try:
        agreement = RankAgreement.resolve(None)
        refused = ""
        try:
            RankAgreement.resolve(dist.group.WORLD)
        except OffloadConfigError as exc:
            refused = str(exc)
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    assert agreement is not None and agreement.group is not None
    own = real(agreement.group)
    got = agreement.launch_max([float(ctx.rank), 10.0 - ctx.rank]).result()
    return {"backend": str(own), "max": got, "refused": refused}


def test_a_job_on_another_backend_agrees_over_a_gloo_group_of_its_own() -> None:
    r0, r1 = launch(_own_gloo_group, 2)
    for r in (r0, r1):
        assert r["backend"] == "gloo" and r["max"] == [1.0, 10.0]
        assert "pass a gloo group" in r["refused"]
