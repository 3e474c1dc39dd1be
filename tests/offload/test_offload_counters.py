"""The cache's counters prove what it did: dedup, parameters kept, forwarding, prefetch order, files freed."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from _offload_models import GPTBlock, assert_identical, mlp, run_steps
from datapath.offload import TensorCache


def _saved_storages(model: nn.Module, x: torch.Tensor, min_bytes: int) -> dict[int, int]:
    """Storages (data_ptr -> nbytes) of the non-parameter tensors autograd saves in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes() >= min_bytes:
            seen[st.data_ptr()] = st.nbytes()
            keep.append(t)  # keep alive so addresses stay unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).square().mean()
    return seen


def test_every_activation_storage_written_once_parameters_never(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[GPTBlock(32, 4) for _ in range(3)])
    x = torch.randn(4, 16, 32)
    expected = _saved_storages(model, x, 1)
    # every saved storage goes to the store (GELU outputs too: not recomputed, see test_offload_op_recompute)
    cache = TensorCache("ssd", str(tmp_path), min_bytes=1, offload_cpu_tensors=True, keep_last_modules=0,
                        io_chunk_bytes=8192, recompute_elementwise=False)
    cache.attach(model)
    with cache:
        loss = model(x).square().mean()
        cache.wait_io()  # every store has finished before the backward starts
        assert len(cache.files()) == len(expected)
        loss.backward()
    st = cache.stats
    assert st.storages_offloaded == len(expected)
    assert st.bytes_offloaded == sum(expected.values())
    assert st.bytes_loaded == st.bytes_offloaded
    assert st.bytes_kept_param > 0  # weights (and their transposes) were saved, and kept
    assert st.dedup_hits > 0 and st.bytes_deduplicated > 0  # q, k, v views of one qkv storage
    assert st.files_created == st.files_removed == len(expected)
    assert cache.files() == []
    cache.close()


def test_dedup_one_write_for_a_storage_saved_by_several_ops() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(64, 64)
    x = torch.randn(128, 64)
    cache = TensorCache("host", min_bytes=1024, offload_cpu_tensors=True, keep_last_modules=0)
    with cache:
        y = lin(x)                       # saved: x (by the linear)
        a = y.sin()                      # saves y
        b = y.cos()                      # saves y again: same storage
        c = y[:, :32] * y[:, 32:]        # saves two views of y
        loss = (a * b).sum() + c.sum()   # saves a and b
        cache.wait_io()
        loss.backward()
    st = cache.stats
    ybytes = 128 * 64 * 4
    assert st.storages_offloaded == 4    # x, y, a, b: each storage once
    assert st.bytes_offloaded == 4 * ybytes
    assert st.dedup_hits == 3            # y by cos, both halves of y
    assert st.bytes_deduplicated == ybytes + 2 * ybytes // 2
    ref_lin = copy.deepcopy(lin)
    for p in ref_lin.parameters():
        p.grad = None
    y = ref_lin(x)
    ((y.sin() * y.cos()).sum() + (y[:, :32] * y[:, 32:]).sum()).backward()
    assert torch.equal(ref_lin.weight.grad, lin.weight.grad)
    cache.close()


def test_forwarding_returns_tensors_still_being_stored(tmp_path) -> None:
    torch.manual_seed(2)
    model = mlp(64, 4)
    batches = [torch.randn(64, 64)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    cache = TensorCache("ssd", str(tmp_path), min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0,
                        io_chunk_bytes=8192)
    gate = threading.Event()
    engine = cache.file_store.posix
    real = engine.pwrite

    def held(fd: int, mv: memoryview, off: int) -> int:  # the disk is "slow": nothing finishes until the gate
        gate.wait()
        return real(fd, mv, off)

    engine.pwrite = held
    cache.attach(model)
    got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache)
    assert_identical(ref, got)
    st = cache.stats
    assert st.bytes_forwarded > 0 and st.stores_cancelled > 0  # handed back from memory, queued stores dropped
    assert st.bytes_loaded == 0                                 # nothing was read back
    gate.set()
    cache.wait_io()
    assert cache.files() == []                                  # the store that was running cleaned up
    cache.close()


def test_prefetch_in_reverse_forward_order_before_backward_needs_it() -> None:
    torch.manual_seed(3)
    model = mlp(64, 6)  # 13 units in a Sequential
    x = torch.randn(64, 64)
    cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=2)
    cache.attach(model)
    with cache:
        model(x).pow(2).mean().backward()  # first step: learns how many units the forward has
        cache.reset_stats()
        loss = model(x).pow(2).mean()
        cache.wait_io()
        loss.backward()
    st = cache.stats
    segs = [s for r, s in st.prefetch_order]
    assert len(segs) >= 6
    assert segs == sorted(segs, reverse=True)   # reverse forward order
    assert st.loads_on_demand == 0              # every load was started ahead of its unpack
    assert st.loads_prefetched == st.storages_offloaded > 0
    assert st.bytes_kept_policy > 0             # the last two units stayed in memory
    cache.close()


def test_inplace_modification_of_a_saved_tensor_is_an_error() -> None:
    w = torch.randn(32, 32, requires_grad=True)
    cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0)
    with cache:
        y = (w * 2).exp()   # exp saves its result
        y.mul_(3)           # autograd forbids this; the offloader must not turn it into a wrong gradient
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    cache.close()


def test_microbatch_hints_interleaved_schedule() -> None:
    torch.manual_seed(4)
    model = mlp(64, 3)
    xs = [torch.randn(32, 64) for _ in range(2)]
    ref = copy.deepcopy(model)
    for x in xs:
        ref(x).pow(2).mean().backward()
    cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=1)
    cache.attach(model)
    with cache:
        losses = []
        for i, x in enumerate(xs):          # forward of both micro-batches first (pipeline warm-up)
            cache.set_microbatch(i)
            losses.append(model(x).pow(2).mean())
        cache.wait_io()
        for i in range(2):                  # then their backwards
            cache.set_microbatch(i)
            cache.prefetch_last_module()
            cache.begin_backward()
            losses[i].backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert cache.stats.records == 2
    assert cache.stats.loads_on_demand == 0
    cache.close()


def test_max_inflight_bytes_bounds_unstored_memory(tmp_path) -> None:
    torch.manual_seed(5)
    model = mlp(64, 4)
    batches = [torch.randn(64, 64) for _ in range(2)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    bound = 3 * 64 * 64 * 4  # three activation storages
    cache = TensorCache("ssd", str(tmp_path), min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0,
                        io_chunk_bytes=8192, max_inflight_bytes=bound)
    real = cache.file_store.posix.pwrite
    gate = threading.Event()
    threading.Timer(0.2, gate.set).start()  # the disk accepts nothing for 0.2 s: the forward must wait

    def slow(fd: int, mv: memoryview, off: int) -> int:
        gate.wait()
        return real(fd, mv, off)
    cache.file_store.posix.pwrite = slow
    cache.attach(model)
    got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache)
    assert_identical(ref, got)
    st = cache.stats
    assert st.store_wait_seconds > 0
    assert 0 < st.peak_inflight_bytes <= bound
    cache.close()


class _Repeats(nn.Module):
    """A layer whose output storage is saved by three ops (sin, cos, mul)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.sin() * h.cos() + h * 0.5


def test_a_kept_storage_saved_again_is_not_a_new_storage() -> None:
    """The adaptive plan counts storages; repeated saves of one it keeps must not look like a changed forward."""
    import dataclasses

    torch.manual_seed(0)
    model = nn.Sequential(*[_Repeats(64) for _ in range(6)])
    x = torch.randn(32, 64)
    ref = copy.deepcopy(model)
    cache = TensorCache("host", policy="adaptive", min_bytes=1024, offload_cpu_tensors=True,
                        host_budget_bytes=64 << 20)
    cache.attach(model)
    for _ in range(3):  # policy "all", then the profiled step, then the planned one
        with cache:
            model(x).square().mean().backward()
    assert cache.plan is not None and cache.profile is not None
    profile = cache.profile
    cache.plan = dataclasses.replace(cache.plan, cutoff=2)  # keep almost everything from now on
    kept0 = cache.stats.bytes_kept_policy
    for _ in range(3):
        with cache:
            model(x).square().mean().backward()
    assert cache.stats.bytes_kept_policy > kept0
    assert cache.profile is profile, "the forward was taken as changed and profiled again"
    cache.close()
    for _ in range(6):
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_max_prefetch_bytes_loads_less_ahead_same_gradients() -> None:
    torch.manual_seed(6)
    model = mlp(64, 6)
    batches = [torch.randn(64, 64) for _ in range(3)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    got, stats = {}, {}
    for limit in (None, 1):
        m = copy.deepcopy(model)
        cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0,
                            prefetch_distance=4, max_prefetch_bytes=limit, host_budget_bytes=16 << 20)
        cache.attach(m)
        got[limit] = run_steps(m, batches, lambda mm, x: mm(x).pow(2).mean(), ctx=cache)
        stats[limit] = cache.stats
        cache.close()
    assert_identical(ref, got[None])
    assert_identical(ref, got[1])
    unbounded, bounded = stats[None], stats[1]
    assert unbounded.bytes_loaded > 0 and bounded.bytes_loaded > 0
    assert 0 < bounded.peak_prefetch_bytes < unbounded.peak_prefetch_bytes
    assert bounded.peak_prefetch_bytes <= 2 * 64 * 64 * 4  # about one segment (one layer's saved input)


@pytest.mark.slow
def test_adaptive_plan_backs_off_when_the_backward_waits_for_loads(tmp_path) -> None:
    """A disk that reads slower than the profile saw: the backward waits, so the next steps offload less."""
    import time as _time

    torch.manual_seed(7)
    model = mlp(256, 6)
    batches = [torch.randn(256, 256) for _ in range(7)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    cache = TensorCache("ssd", str(tmp_path), policy="adaptive", min_bytes=0, offload_cpu_tensors=True,
                        io_chunk_bytes=65536, pace=False)
    cache.attach(model)
    real = cache.file_store.posix.preadv
    slow = {"on": False}

    def preadv(fd: int, bufs: list, off: int) -> int:
        if slow["on"]:
            _time.sleep(0.02)
        return real(fd, bufs, off)
    cache.file_store.posix.preadv = preadv
    plans = []

    def between() -> None:
        plans.append(cache.plan.cutoff if cache.plan is not None else None)
        if cache.plan is not None:
            slow["on"] = True  # from the first planned step on, every read takes 20 ms more
    got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache, between=between)
    assert_identical(ref, got)
    planned = [c for c in plans if c is not None]
    assert planned
    if planned[0] == 0:  # nothing to back off from: the disk probe saw a disk too slow for any store to pay
        w, r = cache.probed_bandwidth()
        cache.close()
        pytest.skip(f"the disk probe measured write {(w or 0) / 1e6:.0f} MB/s, read {(r or 0) / 1e6:.0f} MB/s: too "
                    "slow for the first plan to offload anything (a fresh CI machine still writing back its install)")
    assert cache.stats.plan_backoffs >= 1
    assert planned[-1] < planned[0], plans
    cache.close()


def test_disk_probe_measures_and_leaves_nothing(tmp_path) -> None:
    cache = TensorCache("ssd", str(tmp_path), engine="posix", io_chunk_bytes=1 << 20)
    w, r = cache.store.probe(4 << 20, None)
    assert w > 0 and r > 0
    assert cache.files() == [] and not any(f.startswith("probe") for f in cache.store.files())
    assert cache.store.in_use == 0
    cache.close()


def test_disk_probe_leaves_the_global_rng_alone(tmp_path) -> None:
    cache = TensorCache("ssd", str(tmp_path), engine="posix", io_chunk_bytes=1 << 20)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    cache.store.probe(1 << 20, None)
    assert torch.equal(torch.rand(4), expected)
    cache.close()


@pytest.mark.slow
def test_adaptive_ssd_plans_when_the_disk_probe_has_no_room(tmp_path) -> None:
    torch.manual_seed(8)
    model = mlp(64, 4)
    batches = [torch.randn(64, 64) for _ in range(8)]  # room for re-profiling when no store finished in time
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    cache = TensorCache("ssd", str(tmp_path), policy="adaptive", min_bytes=0, offload_cpu_tensors=True,
                        io_chunk_bytes=8192, max_disk_bytes=4 << 20)  # activations fit, the 8 MiB probe not
    cache.attach(model)
    got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache)
    assert_identical(ref, got)
    assert cache.plan is not None
    cache.close()
