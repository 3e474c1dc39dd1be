"""The native launcher on the GPU: the small gathers it serves equal PyTorch's rows, and it steps aside correctly.

Every case compares with ``table[idx]`` on the CPU and reads ``native_launcher().launches`` to
know which path served the call.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import datapath  # noqa: F401
from datapath.memory import ErrorFlag, check_errors, gather_config, gather_rows, native_launcher
from datapath.unified_tensor import as_unified

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    info = native_launcher(wait=True, timeout=600)
    assert info.status == "ready", info.status


def _launches() -> int:
    return native_launcher().launches


def _counted(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(``fn()``, how many gathers the native launcher made meanwhile)."""
    before = _launches()
    out = fn()
    return out, _launches() - before


def _table(n: int, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *shape, generator=g) * 10).to(dtype)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (64,)), (torch.float32, (256,)), (torch.float32, (1030,)),
                                         (torch.bfloat16, (4, 8)), (torch.uint8, (37,)), (torch.int64, ())])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_small_gathers_go_native_and_equal_pytorch(dtype: torch.dtype, shape: tuple[int, ...],
                                                    idx_dtype: torch.dtype) -> None:
    n = 5000
    t = _table(n, shape, seed=len(shape) + sum(shape), dtype=dtype)  # shape (): a 1-D table, one value a row
    u = as_unified(t.clone())
    u[torch.zeros(1, dtype=idx_dtype, device="cuda")]  # the first call plans the table
    for m in (1, 7, 3001):
        idx = torch.randint(-n, n, (m,), device="cuda", dtype=idx_dtype)
        got, native = _counted(lambda i=idx: u[i])
        assert native == 1, (m, "the native launcher did not serve the call")
        assert got.shape == (m, *shape) and got.dtype == dtype and got.is_cuda
        assert torch.equal(got.cpu(), t[idx.cpu().long()])
    check_errors()


def test_calls_it_does_not_serve_take_the_python_path() -> None:
    n = 4000
    t = _table(n, (48,), seed=3)
    u = t.to("unified")
    idx = torch.randint(0, n, (2000,), device="cuda")
    u[idx]
    cases = {"strided": idx[::2], "2-D": idx.view(40, 50), "empty": idx[:0]}
    for name, i in cases.items():
        got, native = _counted(lambda i=i: u[i])
        assert native == 0, name
        assert torch.equal(got.cpu(), t[i.cpu().long()]), name
    before = _launches()
    old = gather_config.launcher
    try:
        gather_config.launcher = "driver"
        assert torch.equal(u[idx].cpu(), t[idx.cpu()])
        assert _launches() == before
    finally:
        gather_config.launcher = old
    sorted_call = torch.randint(0, n, (40_000,), device="cuda")
    before = _launches()
    assert torch.equal(gather_rows(u, sorted_call, sort=True).cpu(), t[sorted_call.cpu()])
    assert _launches() == before  # a sorted visit is launched from Python
    assert torch.equal(gather_rows(u, sorted_call, sort=False).cpu(), t[sorted_call.cpu()])
    assert _launches() == before + 1  # the caller's order, any size: native
    check_errors()


def test_a_bad_index_is_reported_and_the_context_survives() -> None:
    n = 3000
    t = _table(n, (32,), seed=4)
    u = t.to("unified")
    good = torch.randint(0, n, (500,), device="cuda")
    u[good]
    bad = good.clone()
    bad[123] = n + 17
    rows, native = _counted(lambda: u[bad])  # the kernel records the index and writes zeros for its row
    assert native == 1
    torch.cuda.synchronize()
    assert torch.equal(rows[123].cpu(), torch.zeros(32))
    with pytest.raises(IndexError, match=str(n + 17)):
        u[good]  # the next call of the thread reports it (the native launcher steps aside for that)
    assert torch.equal(u[good].cpu(), t[good.cpu()])
    x = torch.randn(100, device="cuda")
    assert float((x + 1).sum()) == pytest.approx(float(x.sum()) + 100, rel=1e-4)

    flag = ErrorFlag()  # a caller's flag (the loader's way)
    out, native = _counted(lambda: gather_rows(u, bad, error_flag=flag))
    assert native == 1
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=str(n + 17)):
        flag.raise_if_set()
    assert torch.equal(out[:123].cpu(), t[bad[:123].cpu()])


def test_side_streams_and_a_table_freed_behind_its_gather() -> None:
    n = 1 << 16
    t = _table(n, (256,), seed=5)
    u = as_unified(t.clone())
    idx = torch.randint(0, n, (6000,), device="cuda")
    u[idx]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        u[idx]  # plans the side stream
        torch.cuda._sleep(100_000_000)  # the next kernel starts well after the call returns
        got, native = _counted(lambda: u[idx])
        assert native == 1
    del u  # the table's memory is held until the side stream has run the gather
    side.synchronize()
    assert torch.equal(got.cpu(), t[idx.cpu()])
