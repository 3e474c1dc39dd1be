"""Views rebuilt from storage bytes are bit-identical; the host pool hands out aligned, reusable blocks."""
from __future__ import annotations

import pytest
import torch

from datapath.offload import HostStore
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


def test_host_store_alignment_reuse_and_budget() -> None:
    """HostStore: 4 KiB-aligned blocks that do not overlap, freed ranges reused, the budget enforced."""
    store = HostStore(1 << 20, slab_bytes=256 << 10, pinned=False)
    a_src = torch.randint(0, 255, (100_000,), dtype=torch.uint8)
    b_src = torch.randint(0, 255, (50_000,), dtype=torch.uint8)
    a, b = store.reserve(100_000), store.reserve(50_000)
    assert a is not None and b is not None
    for slot, src in ((a, a_src), (b, b_src)):
        res = store.write(slot, src, None, None, "x", lambda: False)
        slot.loc = res.loc
        assert slot.loc.data.data_ptr() % 4096 == 0 and slot.loc.data.numel() == src.numel()
    for slot, src in ((a, a_src), (b, b_src)):  # neither write overwrote the other
        dst = torch.empty_like(src)
        store.read(slot, dst, None, None, "x")  # a read consumes the slot
        assert torch.equal(dst, src)
    assert store.in_use == 0
    c = store.reserve(150_000)  # the freed ranges were merged: fits again
    assert c is not None
    store.unreserve(c)
    assert store.reserve(2 << 20) is None  # over the budget
    big = HostStore(4 << 20, slab_bytes=64 << 10, pinned=False)
    d = big.reserve(1 << 20)
    res = big.write(d, torch.ones(1 << 20, dtype=torch.uint8), None, None, "d", lambda: False)
    d.loc = res.loc  # larger than a slab: a slab of its own
    assert d.loc.data.numel() == 1 << 20
    big.free(d)
    assert big.in_use == 0
