"""The zero-copy gather/scatter kernels against ``table[idx]`` computed by PyTorch on the CPU."""
from __future__ import annotations

import pytest
import torch

from datapath.unified_tensor import ErrorFlag, check_errors, config, gather, scatter

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
          torch.int8, torch.uint8, torch.bool]
MODES = ["circular", "shift_mask", "unaligned"]


def _random_table(n: int, width: int | None, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if width is None else (n, width)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 10).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64).to(dtype)
    return t.pin_memory()


def _poisoned_out(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device="cuda")
    out.view(torch.uint8).fill_(0xA5) if out.numel() else None
    return out


def _check(table: torch.Tensor, idx: torch.Tensor, mode: str, sort: bool | None = None) -> None:
    want = table[idx.cpu().long()]
    out = _poisoned_out(tuple(want.shape), table.dtype)
    got = gather(table, idx, mode=mode, out=out, sort=sort)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), want), (mode, table.dtype, tuple(table.shape), sort)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_every_dtype(dtype: torch.dtype, mode: str) -> None:
    for width in (1, 3, 7, 64, 129, 513):
        table = _random_table(301, width, dtype, seed=width)
        idx = torch.randint(-301, 301, (777,), device="cuda")
        _check(table, idx, mode)
    _check(_random_table(1000, None, dtype, seed=5), torch.randint(0, 1000, (999,), device="cuda"), mode)


@pytest.mark.parametrize("mode", MODES)
def test_every_residue_mod_128_bytes(mode: str) -> None:
    # float32 rows of 1..160 elements cover every residue of the row size mod 128 bytes,
    # and the uint8 rows of 1..256 every byte residue; plus the largest widths.
    for width in [*range(1, 161), 1023, 1024, 1025, 4096, 4097, 4098, 4099]:
        table = _random_table(97, width, torch.float32, seed=width)
        _check(table, torch.randint(0, 97, (200,), device="cuda", dtype=torch.int32), mode)
    for width in range(1, 257):
        table = _random_table(67, width, torch.uint8, seed=width)
        _check(table, torch.randint(0, 67, (150,), device="cuda"), mode)


def test_row_counts_zero_to_a_million() -> None:
    table = _random_table(1 << 21, 5, torch.float32, seed=9)
    for m in (0, 1, 31, 32, 33, 4095, 65537, 1_000_000):
        _check(table, torch.randint(0, table.shape[0], (m,), device="cuda"), "circular")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bfloat16])
def test_sorted_visit_order(mode: str, dtype: torch.dtype) -> None:
    # rows visited in sorted index order land in the caller's positions
    for width in (1, 7, 64, 513):
        table = _random_table(3000, width, dtype, seed=width)
        idx = torch.randint(-3000, 3000, (5000,), device="cuda", dtype=torch.int32)
        idx[100:200] = 42  # repeats
        _check(table, idx, mode, sort=True)
        _check(table, idx, mode, sort=False)
        ref = table.clone()
        perm = torch.randperm(3000, device="cuda")[:1000]
        rows = _random_table(1000, width, dtype, seed=width + 7).cuda()
        scatter(table, perm, rows, mode=mode, sort=True)
        torch.cuda.synchronize()
        ref[perm.cpu()] = rows.cpu()
        assert torch.equal(table, ref)


def test_index_kinds() -> None:
    table = _random_table(500, 33, torch.float32, seed=2)
    for dtype in (torch.int32, torch.int64):
        idx = torch.randint(-500, 500, (1234,), device="cuda", dtype=dtype)
        _check(table, idx, "circular")
    rep = torch.full((300,), 17, device="cuda")  # repeated
    _check(table, rep, "circular")
    two_d = torch.randint(0, 500, (12, 34), device="cuda")
    assert torch.equal(gather(table, two_d).cpu(), table[two_d.cpu()])
    three_d = table.view(500, 3, 11)  # more dims flatten to rows
    assert torch.equal(gather(three_d, two_d).cpu(), three_d[two_d.cpu()])


def test_strided_and_non_contiguous_tables() -> None:
    big = _random_table(400, 50, torch.float32, seed=4)
    idx = torch.randint(0, 200, (300,), device="cuda")
    rows_view = big[::2, 3:41]  # row stride 100 elements, inner contiguous
    assert torch.equal(gather(rows_view, idx).cpu(), rows_view[idx.cpu()])
    col_view = big.t()  # rows not contiguous: generic path, same answer
    idx2 = torch.randint(0, 50, (60,), device="cuda")
    assert torch.equal(gather(col_view, idx2).cpu(), col_view[idx2.cpu()])


def test_non_default_stream() -> None:
    table = _random_table(10_000, 77, torch.float32, seed=6)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        idx = torch.randint(0, 10_000, (50_000,), device="cuda")
        got = gather(table, idx)
        doubled = got * 2  # consumer on the same stream
    s.synchronize()
    assert torch.equal(doubled.cpu(), table[idx.cpu()] * 2)


@pytest.mark.parametrize("bad", [10_000, -10_001, 2**40])
def test_out_of_range_raises_with_value(bad: int) -> None:
    table = _random_table(10_000, 8, torch.float32, seed=7)
    idx = torch.randint(0, 10_000, (4096,), device="cuda")
    idx[1234] = bad
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        gather(table, idx, sync=True)
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        scatter(table, idx, torch.zeros(4096, 8, device="cuda"), sync=True)
    scatter(table, idx, torch.zeros(4096, 8, device="cuda"))  # the default does not wait...
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        check_errors()  # ...and reports at the next synchronisation


def test_async_bounds_check_zeroes_bad_rows_and_raises_later() -> None:
    table = _random_table(100, 8, torch.float32, seed=8)
    idx = torch.tensor([1, 500, 2], device="cuda")
    assert config.sync_bounds_check is False  # the default
    got = gather(table, idx)
    assert torch.equal(got[1].cpu(), torch.zeros(8))  # .cpu() waits for the kernel
    assert torch.equal(got[0].cpu(), table[1])
    with pytest.raises(IndexError, match="index 500"):
        gather(table, torch.tensor([0], device="cuda"))


def test_error_flag_gather_does_not_wait_and_reports_later() -> None:
    table = _random_table(50_000, 33, torch.float32, seed=9)
    good = torch.randint(0, 50_000, (200_000,), device="cuda")
    flag = ErrorFlag()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the stream busy: a call that waited would take that long
    got = gather(table, good, error_flag=flag)
    assert not torch.cuda.current_stream().query()  # returned while the kernel is still queued
    torch.cuda.synchronize()
    flag.raise_if_set()
    assert torch.equal(got.cpu(), table[good.cpu()])
    bad = good.clone()
    bad[777] = 50_000
    got = gather(table, bad, error_flag=flag)  # no raise here, nothing waited for
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="index 50000 is out of bounds"):
        flag.raise_if_set()
    flag.raise_if_set()  # reported once, then cleared
    assert torch.equal(got[777].cpu(), torch.zeros(33))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_scatter(mode: str, dtype: torch.dtype) -> None:
    for width in (1, 5, 32, 513, 1027):
        table = _random_table(600, width, dtype, seed=width)
        ref = table.clone()
        idx = torch.randperm(600, device="cuda")[:250]
        idx[::3] -= 600  # negative indices
        rows = _random_table(250, width, dtype, seed=width + 1).cuda()
        scatter(table, idx, rows, mode=mode)
        torch.cuda.synchronize()
        ref[idx.cpu()] = rows.cpu()
        assert torch.equal(table, ref), (mode, dtype, width)
