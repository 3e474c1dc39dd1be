"""The unified device's API table and placement rules, on CPU (CI) and, where marked, on the GPU."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import datapath
from datapath.unified_tensor import (
    UnifiedTensor, as_unified, gather, host_tensor, is_unified, scatter, set_affinity, to_unified,
)

gpu = pytest.mark.gpu


@pytest.fixture
def table() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(37, 11, generator=g)


def test_to_unified(table: torch.Tensor) -> None:
    u = table.to("unified")
    assert isinstance(u, UnifiedTensor) and u.is_unified and is_unified(u)
    assert not table.is_unified
    assert torch.equal(u.cpu(), table)
    assert type(u.cpu()) is torch.Tensor and type(u.to("cpu")) is torch.Tensor
    assert u.to("unified") is u
    h = u.to("unified", torch.float64)
    assert h.is_unified and h.dtype == torch.float64 and torch.equal(h.cpu(), table.double())
    assert torch.device("cpu") == u.device  # host memory, as PyTorch's C++ side sees it
    assert torch.equal(to_unified(table.t()).cpu(), table.t())


_REGISTERED_SCRIPT = r"""
import torch, datapath
from datapath.unified_tensor import device_registered
assert device_registered()
t = torch.randn(5, 3)
u = t.to("unified")
assert u.device.type == "unified" and u.is_unified, u.device
for make in (torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn):
    x = make(4, 5, device="unified")
    assert x.is_unified and x.device.type == "unified" and x.shape == (4, 5), make
assert torch.equal(torch.zeros(3, device="unified").cpu(), torch.zeros(3))
assert torch.equal(torch.ones(3, device="unified").cpu(), torch.ones(3))
r = torch.rand(1000, device="unified").cpu()
assert 0.0 <= r.min() and r.max() < 1.0 and r.std() > 0.2
assert torch.full((2,), 7, device="unified").tolist() == [7, 7]
assert torch.equal((u * 2).cpu(), t * 2) and (u * 2).device.type == "unified"
assert torch.equal(u[torch.tensor([4, 0])].cpu(), t[[4, 0]])
assert type(u.cpu()) is torch.Tensor
print("registered-ok")
"""


@pytest.mark.slow
def test_registered_device_table() -> None:
    """With the opt-in registration, the device string works everywhere (checked in a fresh process)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DATAPATH_UNIFIED_DEVICE": "1"}
    out = subprocess.run([sys.executable, "-c", _REGISTERED_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "registered-ok" in out.stdout, out.stderr[-3000:]


def test_default_import_leaves_pytorch_accelerator_alone() -> None:
    from datapath.unified_tensor import device_registered

    assert not device_registered()
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


def test_ops_follow_host_affinity(table: torch.Tensor) -> None:
    u = table.to("unified")
    other = torch.randn_like(table)
    cases = {
        "add_cpu": (u + other, table + other),
        "mul_scalar": (u * 2, table * 2),
        "sum": (u.sum(), table.sum()),
        "mean0": (u.mean(0), table.mean(0)),
        "float64": (u.double(), table.double()),
        "slice": (u[3:9], table[3:9]),
        "transpose": (u.t(), table.t()),
        "view": (u.view(-1), table.view(-1)),
        "cmp": (u > 0, table > 0),
        "cat": (torch.cat([u, u]), torch.cat([table, table])),
    }
    for name, (got, want) in cases.items():
        assert got.is_unified, name
        assert torch.equal(got.cpu(), want), name
    assert u.sum().item() == pytest.approx(table.sum().item(), rel=1e-6)


def test_views_share_memory_and_keep_affinity(table: torch.Tensor) -> None:
    u = set_affinity(table.to("unified"), "gpu")
    v = u[2:5]
    assert v.is_unified
    v[0, 0] = 123.0
    assert u.cpu()[2, 0] == 123.0
    assert v.affinity == u.affinity
    w = u.with_affinity("host")
    assert host_tensor(w).data_ptr() == host_tensor(u).data_ptr()


def test_cpu_index_stays_unified(table: torch.Tensor) -> None:
    u = table.to("unified")
    idx = torch.randint(-37, 37, (50,))
    got = u[idx]
    assert got.is_unified and got.affinity == "host"
    assert torch.equal(got.cpu(), table[idx])
    sel = torch.index_select(u, 0, idx.remainder(37))
    assert sel.is_unified and torch.equal(sel.cpu(), table[idx])
    idx2 = torch.randint(0, 37, (3, 4), dtype=torch.int32)
    assert torch.equal(gather(u, idx2), table[idx2.long()])


def test_cpu_scatter_and_index_copy(table: torch.Tensor) -> None:
    u = table.to("unified")
    ref = table.clone()
    idx = torch.randperm(37)[:9]
    rows = torch.randn(9, 11)
    u[idx] = rows
    ref[idx] = rows
    assert torch.equal(u.cpu(), ref)
    idx2 = torch.randperm(37)[:4]
    rows2 = torch.randn(4, 11)
    u.index_copy_(0, idx2, rows2)
    ref.index_copy_(0, idx2, rows2)
    assert torch.equal(u.cpu(), ref)
    scatter(u, torch.tensor([-1]), torch.full((1, 11), 3.5))
    ref[-1] = 3.5
    assert torch.equal(u.cpu(), ref)


def test_inplace_ops_write_host_memory(table: torch.Tensor) -> None:
    u = table.to("unified")
    out = u.add_(1.5)
    assert out is u
    assert torch.equal(u.cpu(), table + 1.5)
    u.index_add_(0, torch.tensor([0, 0, 1]), torch.ones(3, 11))
    ref = table + 1.5
    ref.index_add_(0, torch.tensor([0, 0, 1]), torch.ones(3, 11))
    assert torch.equal(u.cpu(), ref)


def test_conversions(table: torch.Tensor) -> None:
    u = table.to("unified")
    c = u.cpu()
    assert type(c) is torch.Tensor and c.device.type == "cpu" and not c.is_unified
    c[0, 0] = -99.0  # a copy
    assert u.cpu()[0, 0] != -99.0
    n = u.numpy()  # a view, as for CPU tensors
    n[1, 1] = 42.0
    assert u.cpu()[1, 1] == 42.0
    assert np.asarray(u).shape == (37, 11)
    assert u.tolist() == u.cpu().tolist()
    assert torch.equal(copy.deepcopy(u).cpu(), u.cpu())
    assert torch.equal(pickle.loads(pickle.dumps(u)).cpu(), u.cpu())
    assert "unified" in repr(u) and "affinity='host'" in repr(u)


def test_as_unified_shares_memory() -> None:
    arr = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)
    u = as_unified(arr)
    assert u.is_unified and u.shape == (64, 16)
    arr[5, 5] = 777.0
    assert u.cpu()[5, 5] == 777.0
    u[7] = torch.full((16,), -1.0)
    assert (arr[7] == -1.0).all()
    t = torch.randn(8, 3)
    ut = as_unified(t)
    assert host_tensor(ut).data_ptr() == t.data_ptr()
    if torch.cuda.is_available():
        assert host_tensor(ut).is_pinned()


def test_errors(table: torch.Tensor) -> None:
    u = table.to("unified")
    with pytest.raises(IndexError, match="index 37 is out of bounds"):
        u[torch.tensor([0, 37])]
    with pytest.raises(IndexError, match="index -38 is out of bounds"):
        gather(u, torch.tensor([-38]))
    with pytest.raises(TypeError, match="int32 or int64"):
        gather(u, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="affinity"):
        u.affinity = "disk"
    with pytest.raises(ValueError, match="host memory"):
        as_unified(torch.randn(2, device="meta"))
    with pytest.raises(TypeError):
        host_tensor(table)
    with pytest.raises(TypeError, match="dtype"):
        scatter(u, torch.tensor([0]), torch.ones(1, 11, dtype=torch.float64))


@gpu
def test_pin_limit_error() -> None:
    from datapath.memory import PinnedMemoryError, pin_limit_bytes, pinned_empty

    with pytest.raises(PinnedMemoryError, match="can be pinned"):
        pinned_empty((pin_limit_bytes() + 2**30,), torch.uint8)


def test_top_level_exports() -> None:
    assert datapath.is_unified(torch.zeros(1).to("unified"))
    assert datapath.as_unified is as_unified


# --- the same rules on the GPU ----------------------------------------------------------

@gpu
def test_gpu_placement_rules(table: torch.Tensor) -> None:
    u = table.to("unified")
    assert host_tensor(u).is_pinned()
    c = torch.randn_like(table, device="cuda")
    got = u + c  # any CUDA operand: GPU, CUDA result
    assert got.device.type == "cuda" and torch.equal(got.cpu(), table + c.cpu())
    assert (u * 2).is_unified  # host affinity, no CUDA operand: stays unified
    set_affinity(u, "gpu")
    got = u * 2  # gpu affinity: CUDA result, data never moved
    assert got.device.type == "cuda" and torch.equal(got.cpu(), table * 2)
    assert u.sum().device.type == "cuda"
    set_affinity(u, "host")
    idx = torch.randint(-37, 37, (100,), device="cuda")
    g = u[idx]
    assert g.device.type == "cuda" and torch.equal(g.cpu(), table[idx.cpu()])
    s = torch.index_select(u, 0, idx.remainder(37))
    assert s.device.type == "cuda" and torch.equal(s.cpu(), table[idx.cpu()])
    assert u.to("cuda").device.type == "cuda" and torch.equal(u.to("cuda").cpu(), table)
    c2 = torch.randn(11, device="cuda")
    u.add_(c2)  # in place with a CUDA operand: written into host memory by the GPU
    torch.cuda.synchronize()
    assert torch.allclose(u.cpu(), table + c2.cpu())
    v = c.to("unified")
    assert v.is_unified and torch.equal(v.cpu(), c.cpu())


@gpu
def test_gpu_scatter_via_setitem(table: torch.Tensor) -> None:
    u = table.to("unified")
    ref = table.clone()
    idx = torch.randperm(37, device="cuda")[:10]
    rows = torch.randn(10, 11, device="cuda")
    u[idx] = rows
    ref[idx.cpu()] = rows.cpu()
    idx2 = torch.randperm(37, device="cuda")[:5]
    rows2 = torch.randn(5, 11, device="cuda")
    u.index_copy_(0, idx2, rows2)
    ref.index_copy_(0, idx2.cpu(), rows2.cpu())
    torch.cuda.synchronize()
    assert torch.equal(u.cpu(), ref)
    u.index_put_((torch.tensor([1, 1], device="cuda"),), torch.ones(2, 11, device="cuda"), accumulate=True)
    ref.index_put_((torch.tensor([1, 1]),), torch.ones(2, 11), accumulate=True)
    assert torch.equal(u.cpu(), ref)


@gpu
def test_gpu_as_unified_pins_in_place() -> None:
    t = torch.randn(1000, 64)
    assert not t.is_pinned()
    u = as_unified(t)
    assert t.is_pinned()
    idx = torch.randint(0, 1000, (500,), device="cuda")
    assert torch.equal(u[idx].cpu(), t[idx.cpu()])
    del u
    import gc

    gc.collect()
    torch.cuda.synchronize()
    from datapath.memory import pending_host_reads

    assert pending_host_reads() == 0
    assert not t.is_pinned()  # unpinned when the last reference went


@gpu
def test_registration_keeps_cuda_pinning_working() -> None:
    # Renaming PrivateUse1 makes PyTorch treat "unified" as the default accelerator;
    # pin_memory()/is_pinned() without a device must still mean CUDA pinned memory.
    t = torch.randn(64, 8)
    p = t.pin_memory()
    assert p.is_pinned() and not t.is_pinned()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(t), batch_size=16, pin_memory=True)
    batch = next(iter(loader))[0]
    assert batch.is_pinned() and torch.equal(batch, t[:16])


@gpu
def test_cuda_training_works_after_import() -> None:
    # the opt-in PrivateUse1 registration would break this (pytorch#161129); the default import must not
    assert torch.accelerator.current_accelerator().type == "cuda"
    u = torch.randn(100, 16).to("unified")
    w = torch.randn(16, 4, device="cuda", requires_grad=True)
    idx = torch.randint(0, 100, (32,), device="cuda")
    loss = (u[idx] @ w).square().sum()
    loss.backward()
    ref = (u.cpu()[idx.cpu()] @ w.detach().cpu())
    assert torch.allclose(w.grad.cpu(), 2 * u.cpu()[idx.cpu()].t() @ ref, rtol=1e-4, atol=1e-3)
