"""The row fetch's launch path on the GPU: one kernel per call, no waiting, host memory kept alive behind the
launches, outputs of any alignment, tables on 2 MiB pages."""
from __future__ import annotations

import gc

import pytest
import torch

import datapath  # noqa: F401
from datapath.memory import (
    check_errors, gather_config, gather_rows, huge_page_bytes, huge_pinned_empty, native_launcher, pending_host_reads,
    pinned_empty, scatter_rows, thp_mode,
)
from datapath.unified_tensor import as_unified

pytestmark = pytest.mark.gpu


def _table(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * 10


def test_a_gather_neither_waits_nor_launches_more_than_one_kernel() -> None:
    t = _table(50_000, 64, seed=1)
    u = t.to("unified")
    idx = torch.randint(0, 50_000, (8192,), device="cuda")
    gather_rows(u, idx)  # compiled and planned
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in the fetch raises
    try:
        got = u[idx]
        gather_rows(u, idx, sort=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), t[idx.cpu()])
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        u[idx]
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "gather_w" in kernels[0], kernels
    check_errors()


@pytest.mark.parametrize("launcher", ["native", "driver", "cupy"])
def test_every_launcher_from_any_thread_and_stream(launcher: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(gather_config, "launcher", launcher)
    if launcher == "native":
        assert native_launcher(wait=True, timeout=600).status == "ready"
    t = _table(40_000, 48, seed=5)
    u = t.to("unified")
    idx = torch.randint(-40_000, 40_000, (10_000,), device="cuda", dtype=torch.int32)
    want = t[idx.cpu().long()]
    assert torch.equal(u[idx].cpu(), want)
    results: dict[str, torch.Tensor] = {}

    def worker() -> None:  # a new thread: no current CUDA context until something binds one
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            results["rows"] = u[idx]
        side.synchronize()

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert torch.equal(results["rows"].cpu(), want)
    check_errors()


def test_settings_changed_between_calls_reach_the_next_call() -> None:
    from torch.profiler import ProfilerActivity, profile

    t = _table(30_000, 64, seed=6)
    u = t.to("unified")
    idx = torch.randint(0, 30_000, (4096,), device="cuda")
    u[idx]  # the call's lookups made under the default settings (no sorting for 4K rows)
    torch.cuda.synchronize()

    def kernels_of_a_call() -> list[str]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = u[idx]
            torch.cuda.synchronize()
        assert torch.equal(got.cpu(), t[idx.cpu()])
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    assert len(kernels_of_a_call()) == 1
    before = gather_config.sort_indices
    try:
        gather_config.sort_indices = True  # now every call sorts its indices first
        assert len(kernels_of_a_call()) > 1
    finally:
        gather_config.sort_indices = before
    assert len(kernels_of_a_call()) == 1


def test_a_host_table_freed_while_its_gather_runs_is_kept_until_the_gpu_is_done() -> None:
    n, width = 1 << 18, 256  # 256 MiB: the gather runs for milliseconds after the call returns
    for form in ("pinned", "unified"):
        table = pinned_empty((n, width), torch.float32)
        table.copy_(_table(n, width, seed=2))
        want_rows = torch.randint(0, n, (100_000,))
        want = table[want_rows].clone()
        rows_cuda = want_rows.cuda()
        t = table if form == "pinned" else as_unified(table)
        gather_rows(t, rows_cuda[:10])  # read once on the default stream: the next call takes the known-table path
        torch.cuda.synchronize()
        side = torch.cuda.Stream()  # a stream the table has not been read on before
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the kernel starts long (~0.1 s) after the call returns
            got = gather_rows(t, rows_cuda)
        del t, table
        assert pending_host_reads() >= 1  # the freed table is held: the GPU has not read it yet
        junk = pinned_empty((n, width), torch.float32)  # would reuse the block were it released
        junk.fill_(-1.0)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), form
        del junk
    gc.collect()
    assert pending_host_reads() == 0


def test_outputs_of_any_alignment_and_every_grid() -> None:
    t = _table(3000, 32, seed=3)
    u = t.to("unified")
    idx = torch.randint(-3000, 3000, (5000,), device="cuda")
    want = t[idx.cpu()]
    for offset in (0, 1, 2, 3):  # output rows start 0, 4, 8, 12 bytes past a 16-byte boundary
        base = torch.full((5000 * 32 + 8,), float("nan"), device="cuda")
        out = base[offset: offset + 5000 * 32].view(5000, 32)
        assert torch.equal(gather_rows(u, idx, out=out).cpu(), want), offset
    before = gather_config.blocks_per_sm
    try:
        for bps in (1, 3, 8):
            gather_config.blocks_per_sm = bps
            assert torch.equal(u[idx].cpu(), want), bps
            sel = torch.randperm(3000, device="cuda")[:1000]
            rows = torch.randn(1000, 32, device="cuda")
            scatter_rows(u, sel, rows)
            torch.cuda.synchronize()
            assert torch.equal(u.cpu()[sel.cpu()], rows.cpu()), bps
            want = u.cpu()[idx.cpu()]
    finally:
        gather_config.blocks_per_sm = before
    check_errors()


def test_a_table_on_huge_pages() -> None:
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {thp_mode() or 'unknown'} here")
    t = huge_pinned_empty((1 << 16, 128), torch.float32, how="thp")  # 32 MiB
    assert t is not None and t.is_pinned()
    assert huge_page_bytes(t) >= 2 << 20
    t.copy_(_table(1 << 16, 128, seed=4))
    u = as_unified(t)
    idx = torch.randint(0, 1 << 16, (20_000,), device="cuda")
    assert torch.equal(u[idx].cpu(), t[idx.cpu()])
    with pytest.raises(IndexError, match="index 65536 is out of bounds"):
        gather_rows(u, torch.tensor([65536], device="cuda"), sync=True)
    del u, t
    gc.collect()
    torch.cuda.synchronize()
    assert pending_host_reads() == 0
