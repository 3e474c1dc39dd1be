"""One shared copy of a table, attached by several processes."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from datapath.unified_tensor import (
    SharedTableError, attach, cleanup_stale, gather, share, shared_tables, unlink,
)


@pytest.fixture(autouse=True)
def _private_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # a private directory in /dev/shm (RAM-backed, as in use: CUDA can pin its pages), else tmp_path
    shm = Path("/dev/shm")
    d = Path(tempfile.mkdtemp(prefix="datapath-test-", dir=shm)) if shm.is_dir() else tmp_path
    monkeypatch.setenv("DATAPATH_SHM_DIR", str(d))
    yield
    shutil.rmtree(d, ignore_errors=True)


def _child(name: str, shm: str, q: "mp.Queue") -> None:
    os.environ["DATAPATH_SHM_DIR"] = shm
    import datapath  # noqa: F401
    from datapath.unified_tensor import attach as _attach

    t = _attach(name)
    idx = torch.tensor([3, 1, 4, 1, 5])
    q.put(t[idx].cpu().numpy())  # by value: the child exits right after
    t[0] = torch.full((t.shape[1],), -7.0)  # visible to the parent: same pages


@pytest.mark.slow
def test_share_attach_across_processes() -> None:
    x = torch.randn(64, 9)
    u = share(x, "feats")
    assert u.is_unified and torch.equal(u.cpu(), x)
    assert "feats" in shared_tables()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=("feats", os.environ["DATAPATH_SHM_DIR"], q))
    p.start()
    rows = torch.from_numpy(q.get(timeout=120))
    p.join(timeout=120)
    assert p.exitcode == 0
    assert torch.equal(rows, x[torch.tensor([3, 1, 4, 1, 5])])
    assert torch.equal(u.cpu()[0], torch.full((9,), -7.0))  # the child's write, no copy in between
    unlink("feats")
    assert "feats" not in shared_tables()


def test_dtypes_round_trip() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        x = (torch.randn(17, 3) * 50).to(dtype)
        share(x, f"t-{str(dtype)[6:]}")
        got = attach(f"t-{str(dtype)[6:]}")
        assert got.dtype == dtype and torch.equal(got.cpu(), x)
        assert torch.equal(gather(got, torch.tensor([0, 16])), x[[0, 16]])


def test_errors_and_stale_cleanup() -> None:
    tmp_path = Path(os.environ["DATAPATH_SHM_DIR"])
    share(torch.randn(4, 2), "a")
    with pytest.raises(SharedTableError, match="exists"):
        share(torch.randn(4, 2), "a")
    with pytest.raises(SharedTableError, match="no shared table"):
        attach("missing", timeout=0.2)
    with pytest.raises(ValueError, match="names"):
        share(torch.randn(2), "bad/name")
    # a table whose owner died is removed by the next share() / cleanup_stale()
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=os.getpid)
    p.start()
    p.join()
    dead = p.pid
    (tmp_path / "datapath-orphan.bin").write_bytes(b"\0" * 8)
    (tmp_path / "datapath-orphan.json").write_text(json.dumps({"shape": [2], "dtype": "float32", "owner_pid": dead}))
    assert cleanup_stale() == ["orphan"]
    assert not (tmp_path / "datapath-orphan.bin").exists()
    assert "a" in shared_tables()  # a live owner's table stays


@pytest.mark.gpu
def test_gpu_gather_from_shared_table() -> None:
    x = torch.randn(5000, 37)
    u = share(x, "gpu-feats")
    v = attach("gpu-feats")  # a second mapping of the same pages, registered separately
    idx = torch.randint(-5000, 5000, (3000,), device="cuda")
    assert torch.equal(u[idx].cpu(), x[idx.cpu()])
    assert torch.equal(v[idx].cpu(), x[idx.cpu()])
    v[torch.tensor([0], device="cuda")] = torch.ones(1, 37, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(u.cpu()[0], torch.ones(37))


@pytest.mark.gpu
def test_gpu_as_unified_of_a_disk_file_falls_back_to_a_copy(tmp_path: Path) -> None:
    import numpy as np

    from datapath.unified_tensor import as_unified

    arr = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(300, 8))
    arr[:] = np.random.default_rng(0).standard_normal((300, 8))
    u = as_unified(arr)  # regular-file mapping: cannot be pinned in place, copied once
    idx = torch.randint(0, 300, (100,), device="cuda")
    assert torch.equal(u[idx].cpu(), torch.from_numpy(np.asarray(arr))[idx.cpu()])
