"""On CUDA: bit-identical results under a non-default stream, the peak-memory reduction, the kvikio path."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from _offload_models import GPTBlock, assert_identical, run_steps
from datapath.offload import OffloadError, TensorCache

pytestmark = pytest.mark.gpu


def _model(h: int = 256, layers: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[GPTBlock(h, 4, dropout=0.1) for _ in range(layers)]).to("cuda", dtype)


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):  # deterministic backward, so equality is meaningful
        return m(x).float().square().mean()


def _batches(h: int = 256, n: int = 3, b: int = 8, s: int = 128, dtype: torch.dtype = torch.float32):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(b, s, h, device="cuda", dtype=dtype, generator=g) for _ in range(n)]


@pytest.mark.parametrize("target,policy", [("host", "all"), ("host", "adaptive"), ("ssd", "all"),
                                           ("ssd", "adaptive"), ("tiered", "all")])
def test_cuda_identical_on_a_side_stream(target: str, policy: str, tmp_path) -> None:
    model = _model()
    batches = _batches()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ref_model = copy.deepcopy(model)
        ref = run_steps(ref_model, batches, _loss)
        ref2 = run_steps(copy.deepcopy(model), batches, _loss)
        assert_identical(ref, ref2)  # the reference itself is deterministic
        ref += run_steps(ref_model, batches[:1], _loss, seed0=2000)
        cache = TensorCache(target, str(tmp_path) if target != "host" else None, policy=policy, min_bytes=0,
                            engine="posix", verify=True, io_chunk_bytes=1 << 20,
                            host_budget_bytes=(8 << 20) if target == "tiered" else None)
        cache.attach(model)
        got = run_steps(model, batches, _loss, ctx=cache)
        # one more step where every store finishes first, so every storage is reloaded from the target
        got += run_steps(model, batches[:1], _loss, ctx=cache, between=cache.wait_io, seed0=2000)
    torch.cuda.synchronize()
    assert_identical(ref, got)
    st = cache.stats
    assert st.bytes_offloaded > 0 and st.bytes_loaded > 0
    cache.wait_io()
    assert cache.files() == []
    cache.close()
    if cache.directory:
        assert not os.path.exists(cache.directory)


def test_cuda_wait_io_step_identical(tmp_path) -> None:
    model = _model()
    batches = _batches()
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    # the prefetch bound is unbounded here: derived from the measured read bandwidth it shrinks when the disk is
    # busy (other tests), and loads past it are started on demand -- correct, but what this test counts
    cache = TensorCache("ssd", str(tmp_path), min_bytes=0, keep_last_modules=0, engine="posix", verify=True,
                        max_prefetch_bytes=math.inf)
    cache.attach(model)
    got = run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert_identical(ref, got)
    assert cache.stats.bytes_loaded == cache.stats.bytes_offloaded > 0
    assert cache.stats.loads_on_demand == 0
    cache.close()


def _activation_peak(model: nn.Module, x: torch.Tensor, cache: TensorCache | None) -> int:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if cache is None:
        _loss(model, x).backward()
    else:
        with cache:
            loss = _loss(model, x)
            cache.wait_io()
            loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("target", ["host", "ssd"])
def test_cuda_peak_memory_reduced(target: str, tmp_path) -> None:
    h = 1024
    model = _model(h, layers=6, dtype=torch.bfloat16)
    x = _batches(h, n=1, b=8, s=512, dtype=torch.bfloat16)[0]
    keep = _activation_peak(model, x, None)
    # a disk is slower than the forward: bound what may wait to be stored, or the peak forms before it drains
    cache = TensorCache(target, str(tmp_path) if target == "ssd" else None, engine="posix", keep_last_modules=1,
                        max_inflight_bytes=(64 << 20) if target == "ssd" else None)
    cache.attach(model)
    _activation_peak(model, x, cache)  # first step: learns the number of units
    off = _activation_peak(model, x, cache)
    print(f"\nactivation peak keep {keep / 2**20:.1f} MiB, {target} {off / 2**20:.1f} MiB "
          f"({100 * (1 - off / keep):.0f}% lower), offloaded {cache.stats.bytes_offloaded / 2**20:.0f} MiB")
    assert off < 0.6 * keep
    cache.close()


def test_kvikio_path(tmp_path) -> None:
    pytest.importorskip("kvikio")
    try:
        TensorCache("ssd", str(tmp_path), engine="kvikio").close()
    except OffloadError as exc:
        pytest.skip(f"kvikio imports but is not usable here: {exc}")
    model = _model()
    batches = _batches()
    ref = run_steps(copy.deepcopy(model), batches, _loss)
    cache = TensorCache("ssd", str(tmp_path), min_bytes=0, engine="kvikio")
    assert cache.engine == "kvikio"
    cache.attach(model)
    got = run_steps(model, batches, _loss, ctx=cache, between=cache.wait_io)
    assert_identical(ref, got)
    assert cache.stats.bytes_loaded > 0 and cache.files() == []
    cache.close()


def test_closing_a_cache_returns_its_pinned_memory() -> None:
    """A closed cache's pinned slabs leave PyTorch's caching host allocator (before, a freed slab stayed pinned there
    for the life of the process: one process running several caches ran out of host memory)."""
    stats = torch.cuda.host_memory_stats
    if "allocated_bytes.current" not in stats():
        pytest.skip("this torch reports no pinned allocator bytes")
    model = _model()
    batches = _batches(n=2)
    empty = getattr(torch._C, "_host_emptyCache", None) or getattr(torch.accelerator, "empty_host_cache", None)
    if empty is not None:
        empty()  # what earlier tests left cached
    before = stats()["allocated_bytes.current"]
    cache = TensorCache("host", host_budget_bytes=1 << 30, min_bytes=1024)
    cache.attach(model)
    run_steps(model, batches, _loss, ctx=cache)
    torch.cuda.synchronize()
    grown = stats()["allocated_bytes.current"]
    assert grown - before >= 64 << 20, (before, grown)  # the slabs were pinned through the caching allocator
    cache.close()
    after = stats()["allocated_bytes.current"]
    assert after - before <= (grown - before) // 4, (before, grown, after)


def test_cuda_profiled_block_times_leave_out_pacing_waits() -> None:
    """The budget's memory profile runs paced (at each unit the CPU waits for the GPU to catch up): the GPU is busy
    during those waits, so unlike waits for stores they are not taken off a segment's GPU time, and with whole
    blocks as units every block keeps its time (taking them off left the later blocks near zero)."""
    from datapath.offload.budget_profile import forward_times

    layers = 6  # blocks of a few ms on the GPU each, launched in well under that: the CPU runs ahead and waits
    model = _model(h=2048, layers=layers)
    batches = _batches(h=2048, n=1, b=4, s=512)
    # one slab holds the whole step: at most one block stalls on its cudaHostAlloc
    cache = TensorCache("host", memory_budget=1 << 40, min_bytes=1 << 16, host_slab_bytes=4 << 30)
    cache.attach(model, units="blocks")
    run_steps(model, batches, _loss, ctx=cache)  # the first step: the memory profile, everything offloaded
    torch.cuda.synchronize()
    rec = cache.scopes.record
    assert rec is not None and rec.profiling
    if not any(s.pace_wait_s > 0 for s in rec.segments):
        pytest.skip("the CPU never waited for the GPU in this step: no pacing wait to leave out")
    times = forward_times(rec, cache.policy.clock)
    per_block = sorted(sum(t for t, s in zip(times, rec.segments) if s.block == b) for b in range(layers))
    assert per_block[0] > 0.3 * per_block[-2], per_block  # identical blocks take about the same time
    cache.close()


def test_cuda_a_step_that_pins_host_memory_did_one_off_work() -> None:
    """A profiled step that pinned host memory (a cudaHostAlloc stalls every thread's launches) is profiled again:
    `one_off_during` sees a large pinned allocation made since the step began, and nothing else."""
    from datapath.memory import pinned_empty
    from datapath.offload.budget_profile import one_off_during, one_off_work
    from datapath.offload.records import Record

    rec = Record(0, True, None, None)
    rec.one_off_work = one_off_work()
    torch.empty(1 << 20, device="cuda").sum().item()  # device work is not one-off
    assert not one_off_during(rec)
    buf = pinned_empty((64 << 20,), torch.uint8)
    assert buf.is_pinned() and one_off_during(rec)
