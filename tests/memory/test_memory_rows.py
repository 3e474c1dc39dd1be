"""The memory layer's row fetch and read-only tables, on the CPU (the CUDA paths are in test_memory_rows_gpu.py)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import datapath  # noqa: F401  (t.to("unified"))
from datapath.memory import (
    GatherConfig, ReadOnlyTableError, gather_config, gather_rows, gather_tiered, is_read_only, kind_of,
    placement_of, scatter_rows,
)
from datapath.unified_tensor import as_unified


def _table(n: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g) * 10).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.uint8, torch.bfloat16])
def test_cpu_gather_matches_torch(dtype: torch.dtype) -> None:
    t = _table(500, 13, seed=1, dtype=dtype)
    idx = torch.randint(-500, 500, (40, 3))
    for table in (t, t.to("unified"), as_unified(t.clone())):
        got = gather_rows(table, idx)
        assert got.shape == (40, 3, 13) and torch.equal(got, t[idx])
    assert torch.equal(gather_rows(t[:, 2], idx), t[:, 2][idx])  # 1-D and strided tables


def test_cpu_gather_bounds_name_the_index() -> None:
    t = _table(100, 4, seed=2)
    for bad in (100, -101, 2**40):
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for dimension 0 with size 100"):
            gather_rows(t, torch.tensor([0, bad, 3]))
    with pytest.raises(TypeError, match="int32 or int64"):
        gather_rows(t, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="out="):
        gather_rows(t, torch.tensor([0]), out=torch.empty(1, 4))


def test_cpu_scatter_and_read_only_refusal(tmp_path) -> None:
    t = _table(50, 6, seed=3)
    ref = t.clone()
    idx = torch.randperm(50)[:20]
    rows = _table(20, 6, seed=4)
    scatter_rows(t, idx, rows)
    ref[idx] = rows
    assert torch.equal(t, ref)
    np.save(tmp_path / "x.npy", ref.numpy())
    ro = torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="r").copy())
    assert not is_read_only(ro)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    with warnings.catch_warnings():  # torch warns of a non-writable array once per process (whichever test is first)
        warnings.simplefilter("ignore", UserWarning)
        ro_t = torch.from_numpy(mapped)
    assert is_read_only(ro_t) and kind_of(ro_t) == "mmap"
    with pytest.raises(ReadOnlyTableError, match="read-only"):
        scatter_rows(ro_t, torch.tensor([0]), torch.ones(1, 6))
    assert torch.equal(gather_rows(ro_t, idx), ref[idx])  # reading is fine
    assert not is_read_only(torch.from_numpy(np.load(tmp_path / "x.npy", mmap_mode="c")))


def test_read_only_unified_table(tmp_path) -> None:
    """Issue 14 item 4: the segfault case raises a clear error, reads work without a copy."""
    x = _table(10, 5, seed=5)
    np.save(tmp_path / "x.npy", x.numpy())
    a = np.load(tmp_path / "x.npy", mmap_mode="r")
    u = as_unified(a)
    assert u.read_only and is_read_only(u) and placement_of(u) == "unified"
    if not torch.cuda.is_available():
        assert u._host.data_ptr() == a.ctypes.data  # no copy
    with pytest.raises(ReadOnlyTableError, match="read-only unified tensor"):
        u[torch.tensor([0])] = torch.ones(1, 5)
    for write in (lambda: u.add_(1), lambda: u.copy_(torch.zeros(10, 5)), lambda: u[2:4].mul_(3),
                  lambda: u.index_copy_(0, torch.tensor([1]), torch.ones(1, 5)),
                  lambda: torch.add(u, 1, out=u), lambda: u.zero_()):
        with pytest.raises(ReadOnlyTableError):
            write()
    assert torch.equal(u.cpu(), x)  # nothing was written
    idx = torch.tensor([9, 0, -1, 4])
    assert torch.equal(u[idx].cpu(), x[idx]) and torch.equal((u * 2).cpu(), x * 2)
    assert not (u * 2).read_only and u[1:3].read_only
    frozen = np.arange(12, dtype=np.float32).reshape(4, 3)
    frozen.flags.writeable = False
    v = as_unified(frozen)
    assert v.read_only and torch.equal(v[torch.tensor([3])].cpu(), torch.tensor([[9.0, 10.0, 11.0]]))
    with pytest.raises(ReadOnlyTableError):
        v[torch.tensor([0])] = torch.zeros(1, 3)
    w = as_unified(np.arange(6, dtype=np.float32).reshape(2, 3))  # writable array: writable table
    w[torch.tensor([0])] = torch.ones(1, 3)
    assert not w.read_only and w.cpu()[0].tolist() == [1.0, 1.0, 1.0]


def test_tiered_gather_cpu_twin() -> None:
    a, b = _table(30, 7, seed=6), _table(40, 7, seed=7)
    loc = torch.randint(-2, 71, (500,), dtype=torch.int32)
    out = torch.full((500, 7), 123.0)
    counts = torch.zeros(3, dtype=torch.int64)
    gather_tiered(a, b, loc, out, counts=counts)
    v = loc.long()
    for k in range(500):
        if v[k] < 0:
            assert torch.equal(out[k], torch.full((7,), 123.0))  # left for another tier
        elif v[k] == 0:
            assert torch.equal(out[k], torch.zeros(7))
        elif v[k] <= 30:
            assert torch.equal(out[k], a[v[k] - 1])
        else:
            assert torch.equal(out[k], b[v[k] - 31])
    assert counts.tolist() == [int(((v >= 1) & (v <= 30)).sum()), int((v > 30).sum()), int((v < 0).sum())]
    with pytest.raises(ValueError, match="int32"):
        gather_tiered(a, b, loc.long(), out)


def test_sort_rule() -> None:
    cfg = GatherConfig()
    assert not cfg.sorts(4096, 512, 4 << 30) and cfg.sorts(8192, 512, 4 << 30)  # short rows: from 8K ...
    assert not cfg.sorts(16383, 256, 4 << 30) and cfg.sorts(16384, 256, 4 << 30)  # ... and 4 MB
    assert not cfg.sorts(16384, 1024, 4 << 30) and cfg.sorts(32768, 1024, 4 << 30)  # from 32K below 2 KB
    assert cfg.sorts(65536, 512, 4 << 30) and not cfg.sorts(65536, 512, 64 << 20)
    # long rows: from 512 MiB a call, and 65K rows
    assert not cfg.sorts(131071, 2048, 4 << 30) and not cfg.sorts(262143, 2048, 4 << 30)
    assert cfg.sorts(262144, 2048, 4 << 30) and cfg.sorts(131072, 4096, 4 << 30)
    assert not cfg.sorts(65535, 16384, 4 << 30) and cfg.sorts(65536, 16384, 4 << 30)
    assert cfg.sorts(10, 4, 10, sort=True) and not cfg.sorts(1 << 20, 4, 1 << 40, sort=False)
    assert not cfg.sorts(1 << 20, 512, 4 << 30, on_host=False)  # GPU memory: no translation misses to avoid
    with pytest.raises(ValueError, match="sort_indices"):
        cfg.sort_indices = "sometimes"
    assert gather_config.sync_bounds_check is False  # the default does not wait for the GPU
