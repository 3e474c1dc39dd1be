"""Superbatches on the GPU: the loader's batches served from pinned staging, every row equal to the table's."""
from __future__ import annotations

import os

import pytest
import torch

from datapath.features import DiskOptions, DiskReadError, FeatureStore, presample_hotness, write_table
from datapath.graph import generate
from datapath.loaders import NeighborLoader

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("buffers", [1, 2])
def test_gpu_loader_batches_come_from_superbatches(tmp_path, buffers: int) -> None:
    ds = generate("tiny", progress=False, device="cpu")
    n = ds.graph.num_nodes
    t = torch.randn(n, 128, generator=torch.Generator().manual_seed(1))  # 512-byte rows
    write_table(tmp_path / "f.npy", t)
    graph = ds.graph.to("unified")
    hot = presample_hotness(graph, ds.train_idx, [10, 5], batch_size=256, batches=4)
    fs = FeatureStore(tmp_path / "f.npy", gpu_cache="10%", host_memory="80%", hotness=hot,
                      disk=DiskOptions(superbatch=f"{30 * buffers}%", buffers=buffers, scan_read_bytes=256 << 10,
                                       bounce_bytes=256 << 10))
    loader = NeighborLoader(graph, ds.train_idx, [10, 5], 256, shuffle=True, features=fs, labels=ds.labels.cuda(),
                            device="cuda", prefetch=2)
    for epoch in range(2):
        for b in loader:
            assert b.x.device.type == "cuda" and torch.equal(b.x, t[b.input_nodes.cpu()].cuda())
        st = fs.stats()
        d = st["disk"]
        assert d["rows"] > 0 and d["staged_rows"] == d["rows"] and d["staged_missing"] == 0, epoch
        assert sum(s["batches"] for s in d["superbatches"]) == len(loader) and len(d["superbatches"]) >= 2
        assert fs.disk_costs is not None and fs.disk_costs.iops > 0
        fs.reset_stats()
    it = iter(loader)  # an abandoned epoch hands its buffers back
    next(it)
    it.close()
    b = next(iter(loader))
    assert torch.equal(b.x, t[b.input_nodes.cpu()].cuda())
    fs.close()


def test_gpu_superbatch_read_error_names_the_file(tmp_path) -> None:
    ds = generate("tiny", progress=False, device="cpu")
    t = torch.randn(ds.graph.num_nodes, 64)
    p = tmp_path / "f.npy"
    write_table(p, t)
    fs = FeatureStore(p, gpu_cache=0, host_memory="70%", hotness=torch.rand(ds.graph.num_nodes),
                      disk=DiskOptions(superbatch="40%", bounce_bytes=256 << 10, scan_read_bytes=256 << 10))
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 256 * 1024)
    loader = NeighborLoader(ds.graph.to("unified"), ds.train_idx, [10, 5], 256, features=fs, device="cuda")
    with pytest.raises(DiskReadError, match=r"reading .*f\.npy at offset \d+ failed: short read"):
        for _ in loader:
            pass
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # the CUDA context is fine
    fs.close()
