"""The row kernels on the GPU: every table form, every row shape, bounds errors that leave the CUDA context alive."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import datapath  # noqa: F401
from datapath.memory import (
    ErrorFlag, ReadOnlyTableError, check_errors, gather_config, gather_rows, gather_tiered, scatter_rows,
)
from datapath.unified_tensor import as_unified

pytestmark = pytest.mark.gpu


def _table(n: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g) * 10).to(dtype)


def _forms(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same table in every memory the fetch accepts."""
    return {"cuda": t.cuda(), "to_unified": t.to("unified"), "as_unified": as_unified(t.clone()),
            "pinned": t.pin_memory()}


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device="cuda")
    out.view(torch.uint8).fill_(0xA5)
    return out


def _context_alive() -> None:
    x = torch.randn(1000, device="cuda")
    assert abs(float((x * 2).sum()) - 2 * float(x.sum())) < 1e-2


# rows of 1..70 float32 words cover the kernel's short-row paths (4 rows of one step, 2 rows of two
# steps) and its long-row loop; uint8 rows the 1-byte words
@pytest.mark.parametrize("form", ["cuda", "to_unified", "as_unified", "pinned"])
def test_gather_every_form_and_row_width(form: str) -> None:
    for width in (1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 63, 64, 65, 96, 129, 513):
        t = _table(777, width, seed=width)
        table = _forms(t)[form]
        for m, sort in ((1, None), (4099, False), (4099, True)):
            idx = torch.randint(-777, 777, (m,), device="cuda")
            out = _poisoned((m, width), torch.float32)
            got = gather_rows(table, idx, out=out, sort=sort)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(got.cpu(), t[idx.cpu()]), (form, width, m, sort)
    b = torch.randint(0, 256, (300, 37), dtype=torch.uint8)
    idx = torch.randint(0, 300, (1000,), device="cuda", dtype=torch.int32)
    assert torch.equal(gather_rows(_forms(b)[form], idx).cpu(), b[idx.cpu()])
    check_errors()


@pytest.mark.parametrize("form", ["cuda", "to_unified", "pinned"])
def test_out_of_range_raises_and_the_context_survives(form: str) -> None:
    t = _table(1000, 16, seed=3)
    table = _forms(t)[form]
    idx = torch.randint(0, 1000, (5000,), device="cuda")
    idx[1234] = 1000
    got = gather_rows(table, idx)  # does not wait: returns, bad row zeroed
    torch.cuda.synchronize()
    assert torch.equal(got[1234].cpu(), torch.zeros(16))
    with pytest.raises(IndexError, match="index 1000 is out of bounds for dimension 0 with size 1000"):
        gather_rows(table, idx[:10])  # the thread's next fetch reports it
    _context_alive()
    gather_rows(table, torch.tensor([-1001], device="cuda"))
    with pytest.raises(IndexError, match="index -1001 is out of bounds for dimension 0 with size 1000"):
        check_errors()
    with pytest.raises(IndexError, match="index 5000 is out of bounds"):
        gather_rows(table, torch.tensor([3, 5000], device="cuda"), sync=True)  # waits: raises at once
    with pytest.raises(IndexError, match="index 2000 is out of bounds"):
        scatter_rows(table, torch.tensor([2000], device="cuda"), torch.ones(1, 16, device="cuda"), sync=True)
    _context_alive()
    assert torch.equal(gather_rows(table, idx[:10]).cpu(), t[idx[:10].cpu()])  # still usable
    check_errors()


def test_errors_stay_with_their_thread_and_error_flags() -> None:
    t = _table(100, 8, seed=4).cuda()
    flag = ErrorFlag()
    gather_rows(t, torch.tensor([100], device="cuda"), flag)  # the caller's flag: nothing for the thread
    torch.cuda.synchronize()
    gather_rows(t, torch.tensor([1], device="cuda"))
    with pytest.raises(IndexError, match="index 100 is out of bounds for dimension 0 with size 100"):
        flag.raise_if_set()
    seen: list[BaseException] = []

    def other() -> None:
        try:
            gather_rows(t, torch.tensor([-500], device="cuda"))
            torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001
            seen.append(exc)

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert not seen
    gather_rows(t, torch.tensor([2], device="cuda"))  # this thread's flag is clean
    with pytest.raises(IndexError, match="index -500"):
        check_errors()  # covers every thread


def test_scatter_into_host_and_cuda_tables() -> None:
    for form in ("cuda", "to_unified", "pinned"):
        t = _table(600, 33, seed=5)
        table = _forms(t)[form]
        ref = t.clone()
        idx = torch.randperm(600, device="cuda")[:250]
        rows = _table(250, 33, seed=6).cuda()
        scatter_rows(table, idx, rows)
        torch.cuda.synchronize()
        ref[idx.cpu()] = rows.cpu()
        assert torch.equal(table.cpu(), ref), form


def test_read_only_mapping_on_the_gpu(tmp_path) -> None:
    x = _table(4000, 24, seed=7)
    np.save(tmp_path / "x.npy", x.numpy())
    a = np.load(tmp_path / "x.npy", mmap_mode="r")
    u = as_unified(a)
    assert u.read_only
    idx = torch.randint(0, 4000, (3000,), device="cuda")
    assert torch.equal(u[idx].cpu(), x[idx.cpu()])
    for write in (lambda: u.__setitem__(torch.tensor([0]), torch.ones(1, 24)),
                  lambda: u.__setitem__(idx[:2], torch.ones(2, 24, device="cuda")),
                  lambda: scatter_rows(u, idx[:2], torch.ones(2, 24, device="cuda")),
                  lambda: u.add_(torch.ones(24, device="cuda"))):
        with pytest.raises(ReadOnlyTableError):
            write()
    _context_alive()
    assert torch.equal(u.cpu(), x)


@pytest.mark.parametrize("sort", [False, True])
def test_tiered_gather(sort: bool) -> None:
    for width in (1, 7, 32, 64, 130):
        a, b = _table(300, width, seed=width), _table(500, width, seed=width + 1)
        loc = torch.randint(-1, 801, (20_000,), dtype=torch.int32, device="cuda")
        out = _poisoned((20_000, width), torch.float32)
        before = out.clone()
        counts = torch.zeros(3, dtype=torch.int64, device="cuda")
        gather_tiered(a.cuda(), b.pin_memory(), loc, out, counts=counts, sort=sort)
        v = loc.long().cpu()
        want = before.cpu()
        in_a, in_b = (v >= 1) & (v <= 300), v > 300
        want[in_a] = a[v[in_a] - 1]
        want[in_b] = b[v[in_b] - 301]
        want[v == 0] = 0
        assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32)), (width, sort)
        assert counts.tolist() == [int(in_a.sum()), int(in_b.sum()), int((v < 0).sum())]
    for width in (1, 7):  # no rows asked (a shard's exchange may serve none): nothing read, nothing counted
        out = torch.empty((0, width), device="cuda")
        counts = torch.zeros(3, dtype=torch.int64, device="cuda")
        loc = torch.empty(0, dtype=torch.int32, device="cuda")
        assert gather_tiered(_table(3, width, 1).cuda(), _table(5, width, 2).pin_memory(), loc, out, counts=counts,
                             sort=sort) is out
        assert counts.tolist() == [0, 0, 0]
    check_errors()


@pytest.mark.parametrize("method", ["buckets", "buckets_unfused", "torch"])
def test_sorted_visit_over_many_buckets(method: str) -> None:
    """A sorted visit of a table spanning thousands of 64 KiB buckets: every index pattern, both ways of ordering,
    a grid shrunk to one block, the rows written back by a sorted scatter."""
    n, width = 300_000, 128  # 512-byte rows; about one bucket per index, a few for the small calls
    t = _table(n, width, seed=11)
    u = as_unified(t.clone())
    g = torch.Generator().manual_seed(12)
    rand = torch.randint(-n, n, (100_003,), generator=g)
    cases = {"random": rand, "int32": rand.int(), "repeats": torch.randint(0, 40, (70_000,), generator=g) * 7001,
             "sorted": rand.sort().values, "reversed": rand.sort(descending=True).values,
             "one row": torch.full((5000,), n - 1), "small": rand[:3]}
    saved = (gather_config.sort_method, gather_config.host_window_bytes)
    try:
        gather_config.sort_method = method
        for window in (32 << 20, 1):  # the default window, and one that shrinks the grid to its minimum
            gather_config.host_window_bytes = window
            for name, idx in cases.items():
                out = _poisoned((idx.numel(), width), torch.float32)
                gather_rows(u, idx.cuda(), out=out, sort=True)
                assert torch.equal(out.cpu().view(torch.int32), t[idx.long()].view(torch.int32)), (name, window)
        bad = rand.clone().cuda()
        bad[777] = n + 5
        got = gather_rows(u, bad, sort=True)
        torch.cuda.synchronize()
        assert torch.equal(got[777].cpu(), torch.zeros(width))
        with pytest.raises(IndexError, match=f"index {n + 5} is out of bounds"):
            check_errors()
        dst = as_unified(torch.zeros(n, width))
        rows = torch.randperm(n, generator=g)[:90_000].cuda()
        scatter_rows(dst, rows, t[rows.cpu()].cuda(), sort=True)
        torch.cuda.synchronize()
        assert torch.equal(dst[rows].cpu(), t[rows.cpu()])
    finally:
        gather_config.sort_method, gather_config.host_window_bytes = saved
    _context_alive()


def test_sorted_visit_at_the_bucket_limit_and_on_concurrent_streams() -> None:
    """More keys than the ordering's bucket limit (2^20 buckets of several rows), int32 and int64; then sorted
    gathers queued on two streams at once (each stream's ordering has its own grid barrier)."""
    n, width = 3_000_000, 4  # 16-byte rows: a table of more rows than buckets
    t = _table(n, width, seed=21)
    u = as_unified(t.clone())
    g = torch.Generator().manual_seed(22)
    big = torch.randint(-n, n, (2_500_000,), generator=g)
    for idx in (big, big.int()):
        got = gather_rows(u, idx.cuda(), sort=True)
        assert torch.equal(got.cpu().view(torch.int32), t[idx.long()].view(torch.int32))
    sets = [torch.randint(0, n, (300_000 + 7 * k,), generator=g) for k in range(6)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cuda_sets = [s.cuda() for s in sets]
    torch.cuda.synchronize()
    outs = []
    for k, idx in enumerate(cuda_sets):
        with torch.cuda.stream(streams[k % 2]):
            outs.append(gather_rows(u, idx, sort=True))
    torch.cuda.synchronize()
    for idx, got in zip(sets, outs):
        assert torch.equal(got.cpu().view(torch.int32), t[idx].view(torch.int32))
    check_errors()


def test_tiered_gather_sorted_over_many_buckets() -> None:
    a, b = _table(2000, 128, seed=13), _table(250_000, 128, seed=14)
    loc = torch.randint(-1, 252_001, (120_000,), dtype=torch.int32, device="cuda")
    out = _poisoned((120_000, 128), torch.float32)
    before = out.cpu()
    gather_tiered(a.cuda(), b.pin_memory(), loc, out, sort=True)
    v = loc.long().cpu()
    in_a, in_b = (v >= 1) & (v <= 2000), v > 2000
    want = before
    want[in_a] = a[v[in_a] - 1]
    want[in_b] = b[v[in_b] - 2001]
    want[v == 0] = 0
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))
    check_errors()


def test_fused_aggregation_over_every_table_form() -> None:
    """Issue 16: ops.aggregate with src_ids read a unified table out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS)."""
    from datapath.ops import aggregate

    g = torch.Generator().manual_seed(8)
    n_rows, n_src, n_dst, f = 5000, 700, 300, 48
    t = torch.randn(n_rows, f, generator=g)
    deg = torch.randint(0, 12, (n_dst,), generator=g)
    indptr = torch.zeros(n_dst + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    indices = torch.randint(0, n_src, (int(indptr[-1]),), generator=g)
    src_ids = torch.randperm(n_rows, generator=g)[:n_src]
    x = t[src_ids]
    want = torch.zeros(n_dst, f)
    dst = torch.repeat_interleave(torch.arange(n_dst), deg)
    want.index_add_(0, dst, x[indices])
    want /= deg.clamp(min=1).unsqueeze(1).float()
    csr = (indptr.cuda(), indices.cuda(), n_src)
    for name, table in _forms(t).items():
        got = aggregate(csr, table, "mean", src_ids=src_ids.cuda())
        torch.cuda.synchronize()
        assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5), name
    _context_alive()


def test_default_config_does_not_wait() -> None:
    assert gather_config.sync_bounds_check is False
    t = _table(50_000, 33, seed=9).pin_memory()
    idx = torch.randint(0, 50_000, (200_000,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the stream busy: a call that waited would block here
    got = gather_rows(t, idx)
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), t[idx.cpu()])


def test_pinning_in_place_twice_keeps_the_memory_pinned() -> None:
    import gc

    t = _table(20_000, 32, seed=10)
    a, b = as_unified(t), as_unified(t)  # the second call finds the memory pinned by the first
    del a
    gc.collect()
    assert t.is_pinned()  # b still holds a reference on the registration
    idx = torch.randint(0, 20_000, (5000,), device="cuda")
    assert torch.equal(b[idx].cpu(), t[idx.cpu()])
    del b
    gc.collect()
    torch.cuda.synchronize()
    from datapath.memory import pending_host_reads

    assert pending_host_reads() == 0 and not t.is_pinned()
    p = torch.randn(100, 8).pin_memory()  # pinned by its allocator: wrapped as it is
    assert torch.equal(as_unified(p)[torch.tensor([3], device="cuda")].cpu(), p[[3]])
