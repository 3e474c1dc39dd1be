"""Views rebuilt from storage bytes are bit-identical; the host pool hands out aligned, reusable blocks."""
from __future__ import annotations

import pytest
import torch

from datapath.offload._host_pool import ALIGN, HostPool
from datapath.offload.views import ViewSpec, is_plain_strided, rebuild, storage_bytes


def _roundtrip(t: torch.Tensor) -> torch.Tensor:
    data = storage_bytes(t).clone()  # a copy of the whole storage, as a load gives it
    return rebuild(data, ViewSpec.of(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.uint8, torch.complex64])
def test_views_of_every_layout(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(6, 10, 8, generator=g) * 10).to(dtype) if dtype != torch.complex64 else \
        torch.randn(6, 10, 8, dtype=dtype, generator=g)
    views = [base, base[2:5], base[:, 3:7, 1], base.transpose(0, 2), base[..., ::3], base.flatten()[7:41],
             base.unsqueeze(1).expand(6, 4, 10, 8)]
    for v in views:
        r = _roundtrip(v)
        assert r.shape == v.shape and r.stride() == v.stride() and r.storage_offset() == v.storage_offset()
        assert r.dtype == v.dtype
        assert torch.equal(r, v)
        assert r.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


def test_conj_and_neg_views() -> None:
    z = torch.randn(5, 7, dtype=torch.complex64)
    for v in (z.conj(), z.conj()[1:, ::2], torch._neg_view(z), z.conj().imag):
        r = _roundtrip(v)
        assert r.is_conj() == v.is_conj() and r.is_neg() == v.is_neg()
        assert torch.equal(r.resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg())


def test_plain_strided_filter() -> None:
    assert is_plain_strided(torch.randn(3))
    assert is_plain_strided(torch.nn.Parameter(torch.randn(3)))
    assert not is_plain_strided(torch.randn(4, 4).to_sparse())
    assert not is_plain_strided(torch.empty(3, device="meta"))


def test_host_pool_alignment_reuse_and_budget() -> None:
    pool = HostPool(budget=1 << 20, slab_bytes=256 << 10, pinned=False)
    assert pool.try_reserve(100_000) and pool.try_reserve(50_000)
    a = pool.alloc(100_000)
    b = pool.alloc(50_000)
    for blk in (a, b):
        assert blk.data.data_ptr() % ALIGN == 0 and blk.data.numel() == blk.nbytes
    a.data.fill_(1)
    b.data.fill_(2)
    assert int(a.data.sum()) == 100_000  # blocks do not overlap
    cap = pool.capacity
    pool.free(a)
    pool.free(b)
    assert pool.in_use == 0 and pool.reserved == 0
    assert pool.try_reserve(150_000)
    c = pool.alloc(150_000)  # the freed ranges were merged: fits in the same slab
    assert pool.capacity == cap
    pool.free(c)
    assert not pool.try_reserve(2 << 20)  # over the budget
    big = HostPool(budget=4 << 20, slab_bytes=64 << 10, pinned=False)
    assert big.try_reserve(1 << 20)
    d = big.alloc(1 << 20)  # larger than a slab: a slab of its own
    assert d.data.numel() == 1 << 20
    big.free(d)
