"""The feature store on the GPU: cache, host and disk tiers in one batch, bounds errors, the loader on top."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from datapath.features import DiskOptions, FeatureStore, presample_hotness
from datapath.features.disk import native_aio_available
from datapath.graph import generate
from datapath.loaders import NeighborLoader
from datapath.memory import check_errors
from datapath.unified_tensor import as_unified

pytestmark = pytest.mark.gpu
ENGINES = ["threads"] + (["aio"] if native_aio_available() is None else [])


def _table(n: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("engine", ENGINES)
def test_three_tiers_in_one_batch(tmp_path, engine: str) -> None:
    t = _table(50_000, 33, seed=1)  # 132-byte rows
    np.save(tmp_path / "f.npy", t.numpy())
    hot = torch.rand(50_000, generator=torch.Generator().manual_seed(2))
    fs = FeatureStore(tmp_path / "f.npy", gpu_cache="10%", host_memory="25%", hotness=hot,
                      disk=DiskOptions(engine=engine))
    assert fs.device.type == "cuda" and fs.tiers()["disk"]["rows"] == 32_500
    for m in (1, 1000, 60_000):
        idx = torch.randint(-50_000, 50_000, (m,), device="cuda")
        got = fs[idx]
        assert got.device.type == "cuda" and torch.equal(got.cpu(), t[idx.cpu()]), m
    st = fs.stats()
    assert st["gpu_cache"]["rows"] > 0 and st["host"]["rows"] > 0 and st["disk"]["rows"] > 0
    assert st["gpu_cache"]["seconds"] > 0 and st["disk"]["read_bytes"] >= st["disk"]["bytes"]
    check_errors()
    fs.close()


def test_tensor_tables_every_form() -> None:
    t = _table(20_000, 64, seed=3)
    hot = torch.rand(20_000)
    idx = torch.randint(0, 20_000, (30_000,), device="cuda")
    for table in (t, t.to("unified"), as_unified(t.clone()), t.cuda()):
        for cache in (0, "25%", "100%"):
            fs = FeatureStore(table, gpu_cache=cache, hotness=hot)
            assert torch.equal(fs[idx].cpu(), t[idx.cpu()])
            assert fs.stats()["gpu_cache" if cache == "100%" or table.is_cuda else "host"]["rows"] > 0 or cache
    check_errors()


def test_bad_index_raises_and_the_context_survives(tmp_path) -> None:
    t = _table(10_000, 16, seed=4)
    np.save(tmp_path / "f.npy", t.numpy())
    for fs in (FeatureStore(t, gpu_cache="20%", hotness=torch.rand(10_000)),
               FeatureStore(tmp_path / "f.npy", gpu_cache="20%", host_memory="20%", hotness=torch.rand(10_000))):
        idx = torch.randint(0, 10_000, (5000,), device="cuda")
        idx[77] = 10_000
        with pytest.raises(IndexError, match="index 10000 is out of bounds for dimension 0 with size 10000"):
            fs[idx]  # raised here by a store with a disk tier (it synchronises for the disk rows) ...
            check_errors()  # ... else by the next synchronisation
        x = torch.randn(100, device="cuda")
        assert torch.isfinite((x @ x).cpu())  # the CUDA context is alive
        assert torch.equal(fs[idx[:50]].cpu(), t[idx[:50].cpu()])
        fs.close()


def test_loader_with_a_store_gives_the_same_batches(tmp_path) -> None:
    ds = generate("tiny", progress=False)
    np.save(tmp_path / "f.npy", ds.features.numpy())
    graph = ds.graph.to("cuda")
    hot = presample_hotness(graph, ds.train_idx, [10, 5], batch_size=512, batches=8)
    stores = [FeatureStore(ds.features, gpu_cache="20%", hotness=hot),
              FeatureStore(tmp_path / "f.npy", gpu_cache="20%", host_memory="30%", hotness=hot)]
    for fs in stores:
        ref = NeighborLoader(graph, ds.train_idx, [10, 5], 512, features=ds.features.cuda(),
                             labels=ds.labels.cuda(), shuffle=True, seed=3)
        loader = NeighborLoader(graph, ds.train_idx, [10, 5], 512, features=fs, labels=ds.labels.cuda(),
                                shuffle=True, seed=3)
        n = 0
        for a, b in zip(loader, ref):
            assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
            n += 1
        assert n == len(loader)
        assert fs.stats()["gpu_cache"]["hit_rate"] > 0.2
        fs.close()
