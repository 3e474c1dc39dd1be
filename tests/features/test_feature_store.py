"""The tiered feature store on the CPU: budgets, table files, read plans, every tier mix, disk errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from datapath.features import (
    DiskOptions, DiskReadError, FeatureStore, FeatureStoreError, TableFile, degree_hotness, parse_budget, place_graph,
    presample_hotness,
)
from datapath.features.disk import native_aio_available, plan_reads
from datapath.features.hotness import rank
from datapath.graph import generate

ENGINES = ["threads"] + (["aio"] if native_aio_available() is None else [])


def _table(n: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _save(tmp_path, t: torch.Tensor, name: str = "f.npy") -> str:
    p = tmp_path / name
    np.save(p, t.numpy())
    return str(p)


def test_budgets_parse_or_name_the_argument() -> None:
    total = 1000
    assert parse_budget("25%", total, "x") == 250 and parse_budget(" 2.5 % ", total, "x") == 25
    assert parse_budget("16GB", total, "x") == 16 * 10**9 and parse_budget("10GiB", total, "x") == 10 * 2**30
    assert parse_budget("512mb", total, "x") == 512 * 10**6 and parse_budget("4G", total, "x") == 4 * 2**30
    assert parse_budget(0.5, total, "x") == 500 and parse_budget(4096, total, "x") == 4096
    assert parse_budget(None, total, "x") is None and parse_budget("0", total, "x") == 0
    for bad in ("25 percent", "lots", "-3GB", "150%", "%", 1.5, -1, True, [1]):
        with pytest.raises(FeatureStoreError, match="--gpu-cache"):
            parse_budget(bad, total, "--gpu-cache")


def test_table_file_checks(tmp_path) -> None:
    t = _table(100, 6)
    p = _save(tmp_path, t)
    tf = TableFile.open(p)
    assert tf.shape == (100, 6) and tf.dtype == torch.float32 and tf.row_bytes == 24
    assert tf.offset == os.path.getsize(p) - 2400
    assert np.array_equal(tf.memmap(), t.numpy())
    with pytest.raises(FeatureStoreError, match="does not exist"):
        TableFile.open(tmp_path / "missing.npy")
    with pytest.raises(FeatureStoreError, match="shape"):
        TableFile.open(p, shape=(100, 7))
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 10)
    with pytest.raises(FeatureStoreError, match=r"f\.npy has .* bytes but .* needs"):
        TableFile.open(p)
    raw = tmp_path / "rows.bin"
    t.numpy().tofile(raw)
    with pytest.raises(FeatureStoreError, match="give its shape and dtype"):
        TableFile.open(raw)
    with pytest.raises(FeatureStoreError, match="needs"):
        TableFile.open(raw, shape=(101, 6), dtype=torch.float32)
    assert TableFile.open(raw, shape=(100, 6), dtype=torch.float32).offset == 0


@pytest.mark.parametrize("row_bytes,offset", [(512, 128), (148, 128), (4096, 0), (6000, 64), (8, 4096)])
def test_read_plan_covers_every_row(row_bytes: int, offset: int) -> None:
    rng = np.random.default_rng(row_bytes)
    n = 5000
    data = rng.integers(0, 256, offset + n * row_bytes + 4096, dtype=np.uint8)
    ids = np.unique(rng.integers(0, n, 1500))
    plan = plan_reads(ids, offset, row_bytes, max_read_bytes=16 << 10)
    assert (plan.offsets % 4096 == 0).all() and (plan.lengths % 4096 == 0).all()
    row_pages = -(-row_bytes // 4096) + 1  # a read may run past the cap by the pages of its last row
    assert (plan.lengths <= (16 << 10) + row_pages * 4096).all()
    assert (np.diff(plan.offsets) > 0).all()  # sorted
    assert (plan.offsets[1:] >= plan.offsets[:-1] + plan.lengths[:-1] - 4096).all()  # overlap at most a page
    staging = np.zeros(plan.nbytes, np.uint8)
    for off, ln, at in zip(plan.offsets, plan.lengths, plan.staging):
        staging[at:at + ln] = data[off:off + ln]
    for i, r in enumerate(ids):
        got = staging[plan.row_at[i]:plan.row_at[i] + row_bytes]
        assert np.array_equal(got, data[offset + r * row_bytes: offset + (r + 1) * row_bytes])
    dense = plan_reads(np.arange(0, 64, dtype=np.int64), 0, 512)
    assert dense.offsets.size == 1 and dense.nbytes == 8 * 4096  # adjacent rows: one merged read


@pytest.mark.parametrize("engine", ENGINES)
def test_every_tier_mix_gives_the_table_rows(tmp_path, engine: str) -> None:
    t = _table(6000, 37, seed=1)  # 148-byte rows: rows straddle pages
    p = _save(tmp_path, t)
    hot = torch.rand(6000, generator=torch.Generator().manual_seed(2))
    idx = torch.randint(-6000, 6000, (3000, 2), generator=torch.Generator().manual_seed(3))
    for cache, host in (("10%", "30%"), (0, "20%"), ("50%", 0), (None, None), ("100%", None), (0, "100%")):
        fs = FeatureStore(p, gpu_cache=cache, host_memory=host, hotness=hot, disk=DiskOptions(engine=engine))
        got = fs[idx]
        assert got.shape == (3000, 2, 37) and torch.equal(got, t[idx]), (cache, host)
        st = fs.stats()
        assert sum(s["rows"] for s in st.values()) == idx.numel()
        assert abs(sum(s["hit_rate"] for s in st.values()) - 1.0) < 1e-9
        fs.close()
    fs = FeatureStore(p, gpu_cache="10%", host_memory="30%", hotness=hot, disk=DiskOptions(engine=engine))
    tiers = fs.tiers()
    assert tiers["gpu_cache"]["rows"] == 600 and tiers["host"]["rows"] == 1800 and tiers["disk"]["rows"] == 3600
    cached = rank(hot)[:600]  # the hottest rows are the cached ones
    fs.reset_stats()
    assert torch.equal(fs[cached], t[cached]) and fs.stats()["gpu_cache"]["hit_rate"] == 1.0
    disk = fs.stats()["disk"]
    assert disk["rows"] == 0 and disk["reads"] == 0
    fs.close()


def test_a_gather_in_two_parts(tmp_path) -> None:
    """start_gather reads the cache and host rows; finish adds the disk rows (what a loader's exchange stage does
    for a collective store)."""
    t = _table(3000, 19, seed=4)
    fs = FeatureStore(_save(tmp_path, t), gpu_cache="10%", host_memory="20%",
                      hotness=torch.rand(3000, generator=torch.Generator().manual_seed(5)))
    assert not fs.collective
    idx = torch.randint(-3000, 3000, (700, 3), generator=torch.Generator().manual_seed(6))
    pending = fs.start_gather(idx)
    assert pending.out.shape == (700, 3, 19)
    disk_rows = fs.stats()["disk"]["rows"]
    assert disk_rows == 0  # nothing read from the disk yet
    got = pending.finish()
    assert got is pending.out and torch.equal(got, t[idx]) and fs.stats()["disk"]["rows"] > 0
    assert pending.finish() is got  # idempotent
    with pytest.raises(IndexError):  # on the CPU at the lookup; on a GPU by finish, before any disk read
        fs.start_gather(torch.tensor([1, 3000])).finish()
    fs.close()


def test_tensor_tables_and_bad_input(tmp_path) -> None:
    t = _table(3000, 16, seed=4)
    idx = torch.randint(0, 3000, (777,))
    for cache in (0, "30%", "100%", 1.0):
        fs = FeatureStore(t, gpu_cache=cache, hotness=torch.rand(3000))
        assert torch.equal(fs[idx], t[idx])
    with pytest.raises(FeatureStoreError, match="gpu_cache=.*larger than the table"):
        FeatureStore(t, gpu_cache="1GB")
    with pytest.raises(FeatureStoreError, match="host_memory"):
        FeatureStore(t, host_memory="10%")
    with pytest.raises(FeatureStoreError, match="gpu_cache='lots' does not parse"):
        FeatureStore(t, gpu_cache="lots")
    with pytest.raises(FeatureStoreError, match="does not exist"):
        FeatureStore(tmp_path / "nope.npy")
    with pytest.raises(FeatureStoreError, match="hotness must hold one score per row"):
        FeatureStore(t, gpu_cache="10%", hotness=torch.rand(5))
    fs = FeatureStore(t, gpu_cache="30%", hotness=torch.rand(3000))
    with pytest.raises(IndexError, match="index 3000 is out of bounds"):
        fs[torch.tensor([1, 3000])]
    with pytest.raises(TypeError, match="int32/int64 tensor of row ids"):
        fs[3]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_short_read_names_the_file_and_offset(tmp_path, engine: str) -> None:
    t = _table(20_000, 32, seed=5)
    p = _save(tmp_path, t)
    fs = FeatureStore(p, gpu_cache=0, host_memory="10%", hotness=torch.arange(20_000, 0, -1),
                      disk=DiskOptions(engine=engine))
    tail = torch.arange(19_000, 20_000)  # on disk (the coldest rows)
    assert torch.equal(fs[tail], t[tail])
    size = os.path.getsize(p)
    with open(p, "r+b") as f:  # the file shrinks under the store
        f.truncate(size - 64 * 1024)
    with pytest.raises(DiskReadError, match=r"reading .*f\.npy at offset \d+ failed: short read") as err:
        fs[tail]
    assert err.value.filename.endswith("f.npy") and err.value.offset > 0
    fs.close()


def test_hotness_rankings() -> None:
    ds = generate("tiny", progress=False, device="cpu")
    deg = degree_hotness(ds.graph)
    assert deg.shape == (ds.graph.num_nodes,) and torch.equal(deg, ds.graph.in_degrees())
    hot = presample_hotness(ds.graph, ds.train_idx, [10, 5], batch_size=256, batches=4)
    assert hot.shape == deg.shape and int((hot > deg).sum()) > 1000  # sampled nodes score above degree alone
    order = rank(hot)
    assert torch.equal(torch.sort(order).values, torch.arange(ds.graph.num_nodes))
    assert hot[order[0]] == hot.max()
    assert place_graph(ds.graph) is ds.graph or not torch.cuda.is_available()
