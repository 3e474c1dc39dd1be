"""The disk tier's reads: bytes read against pages needed, the cost model, scans, and superbatches on the CPU loader."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from datapath.features import DiskOptions, DiskReadError, FeatureStore, FeatureStoreError, TableFile, write_table
from datapath.features.disk import DiskReader, native_aio_available, plan_reads
from datapath.features.scan import BOUNCE_BUFFERS, choose_gap, DiskCosts, GAPS, probe_disk, read_rows, SCAN
from datapath.graph import generate
from datapath.loaders import NeighborLoader

ENGINES = ["threads"] + (["aio"] if native_aio_available() is None else [])
SMALL = dict(scan_read_bytes=64 << 10, bounce_bytes=128 << 10)  # small reads and buffers for small files


def _table(n: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _pages(ids: np.ndarray, offset: int, row_bytes: int) -> int:
    """Distinct 4 KiB pages that rows ``ids`` touch."""
    start = offset + ids * row_bytes
    lo, hi = start // 4096, (start + row_bytes - 1) // 4096
    return np.unique(np.concatenate([lo, hi])).size


def test_write_table_aligns_rows_to_pages(tmp_path) -> None:
    t = _table(3000, 128, seed=1)
    tf = write_table(tmp_path / "a.npy", t)
    assert tf.offset == 4096 and tf.shape == (3000, 128) and tf.dtype == torch.float32
    assert np.array_equal(np.load(tmp_path / "a.npy"), t.numpy())
    big = write_table(tmp_path / "b.npy", t[:, :3].contiguous(), align=8192)
    assert big.offset == 8192 and np.array_equal(np.load(tmp_path / "b.npy"), t[:, :3].numpy())
    with pytest.raises(FeatureStoreError, match="align must be a power of two"):
        write_table(tmp_path / "b.npy", t, align=1 << 17)
    with pytest.raises(FeatureStoreError, match="C-contiguous"):
        write_table(tmp_path / "c.npy", t.numpy()[:, ::2])


@pytest.mark.parametrize("aligned", [True, False])
def test_disk_tier_reads_only_the_pages_it_needs(tmp_path, aligned: bool) -> None:
    t = _table(40_000, 128, seed=2)  # 512-byte rows: 8 a page
    p = tmp_path / "f.npy"
    if aligned:
        write_table(p, t)
    else:
        np.save(p, t.numpy())  # numpy's 128-byte header: one row in eight straddles two pages
    tf = TableFile.open(p)
    fs = FeatureStore(p, gpu_cache=0, host_memory=0, disk=DiskOptions(max_read_bytes=4096 if aligned else 256 << 10))
    ids = torch.randperm(40_000, generator=torch.Generator().manual_seed(3))[:3000]
    assert torch.equal(fs[ids], t[ids])
    st = fs.stats()["disk"]
    uniq = np.unique(ids.numpy())
    need = _pages(uniq, tf.offset, 512)
    plan = plan_reads(uniq, tf.offset, 512, 4096 if aligned else 256 << 10)
    assert st["read_bytes"] == plan.nbytes and st["reads"] == plan.offsets.size
    if aligned:  # one page a row (rows sharing a page share its read), and no other page
        assert st["read_bytes"] == need * 4096 == np.unique(uniq // 8).size * 4096
    else:  # each needed page once, but for a page shared by the two reads a long run is cut into
        cut = int((plan.offsets[1:] < plan.offsets[:-1] + plan.lengths[:-1]).sum())
        assert st["read_bytes"] == (need + cut) * 4096 and cut <= plan.offsets.size // 8
        assert need > np.unique(uniq // 8).size  # the straddling rows' second pages
    fs.close()


def test_choose_gap_predicts_the_plans_and_picks_by_cost() -> None:
    rng = np.random.default_rng(4)
    for density in (0.002, 0.05, 0.6):
        ids = np.flatnonzero(rng.random(200_000) < density).astype(np.int64)
        slow_seek = DiskCosts(iops=80_000, seq_GBps=2.6)
        choice = choose_gap(ids, 128, 512, slow_seek, max_read_bytes=1 << 20)
        for c in choice.candidates:
            g = c["max_gap_pages"]
            plan = plan_reads(ids, 128, 512, (256 << 10) if g == 0 else 1 << 20, max_gap_pages=g)
            # the plan cuts long runs where a row starts, skipping the gap there: at most what is predicted, and
            # close to it where the gaps are short (dense rows) or not read (g = 0)
            assert plan.nbytes <= c["bytes"] + 4096 * plan.offsets.size, (density, g)  # a page shared at a cut
            if density >= 0.05 or g == 0:
                assert plan.nbytes >= 0.95 * c["bytes"], (density, g)
                assert abs(c["reads"] - plan.offsets.size) <= max(2, 0.05 * plan.offsets.size), (density, g)
        assert choice.seconds == min(c["seconds"] for c in choice.candidates)
        if density == 0.6:  # nearly every page needed: large reads of the whole stretch
            assert choice.nbytes >= 0.99 * 200_000 * 512 and choice.reads <= 200_000 * 512 // (200 << 10)
        if density == 0.05:  # a third of the pages: reading short gaps beats a read per run
            assert choice.mode != "pages" and choice.reads < 0.5 * choice.candidates[0]["reads"]
        if density == 0.002:  # sparse rows: no scan (the model merges gaps shorter than a read's cost)
            assert choice.mode != "scan" and choice.nbytes < 0.5 * 200_000 * 512
    ids = np.flatnonzero(rng.random(200_000) < 0.05).astype(np.int64)
    fast_seek = DiskCosts(iops=5e7, seq_GBps=0.5)  # reads free, bytes dear: read only the needed pages
    assert choose_gap(ids, 128, 512, fast_seek).mode == "pages"
    assert {c["max_gap_pages"] for c in choose_gap(ids, 128, 512, fast_seek).candidates} == set(GAPS)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("row_bytes,aligned", [(512, True), (512, False), (148, False), (8192, True)])
def test_read_rows_every_way_gives_the_rows(tmp_path, engine: str, row_bytes: int, aligned: bool) -> None:
    n = 6000
    t = _table(n, row_bytes // 4, seed=5)
    p = tmp_path / "f.npy"
    write_table(p, t) if aligned else np.save(p, t.numpy())
    tf = TableFile.open(p)
    reader = DiskReader(tf, engine)
    ids = np.unique(np.random.default_rng(6).integers(0, n, 1500)).astype(np.int64)
    ids[-1] = n - 1  # the last row of the file
    for g in GAPS:
        out = torch.empty(ids.size, row_bytes, dtype=torch.uint8)
        res = read_rows(reader, tf, ids, out, g, max_read_bytes=64 << 10)
        assert torch.equal(out.view(torch.float32), t[torch.from_numpy(ids)]), g
        assert res.read_bytes == plan_reads(ids, tf.offset, row_bytes, 64 << 10, max_gap_pages=g).nbytes
        if g == SCAN and row_bytes < 4096:  # (wide rows: the cuts between reads skip the gaps there)
            assert res.read_bytes >= 0.9 * (ids[-1] - ids[0]) * row_bytes  # the whole stretch (not gaps at cuts)
    reader.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_short_read_of_a_scan_names_the_file_and_offset(tmp_path, engine: str) -> None:
    t = _table(20_000, 32, seed=7)
    p = tmp_path / "f.npy"
    write_table(p, t)
    tf = TableFile.open(p)
    ids = np.arange(0, 20_000, 3, dtype=np.int64)
    reader = DiskReader(tf, engine)
    with open(p, "r+b") as f:  # the file shrinks under the reader
        f.truncate(os.path.getsize(p) - 64 * 1024)
    for g in (0, SCAN):
        out = torch.empty(ids.size, 128, dtype=torch.uint8)
        with pytest.raises(DiskReadError, match=r"reading .*f\.npy at offset \d+ failed: short read") as err:
            read_rows(reader, tf, ids, out, g, max_read_bytes=64 << 10)
        assert err.value.filename.endswith("f.npy") and err.value.offset > 0
    reader.close()


def test_probe_measures_random_and_sequential_reads(tmp_path) -> None:
    write_table(tmp_path / "f.npy", _table(50_000, 64, seed=8))
    c = probe_disk(TableFile.open(tmp_path / "f.npy"), random_reads=2000, depths=(16, 64), seq_bytes=8 << 20,
                   seq_read_bytes=1 << 20, bounce_bytes=4 << 20)
    assert c.iops > 0 and c.seq_GBps > 0 and set(c.detail["by_depth"]) == {16, 64}
    assert c.iops == max(v["iops"] for v in c.detail["by_depth"].values())
    assert c.detail["seq_bytes"] == 8 << 20 and c.as_dict()["random_GBps"] == pytest.approx(c.iops * 4096 / 1e9)


def _graph_store(tmp_path, superbatch: str, buffers: int = 1, host: str = "75%"):
    ds = generate("tiny", progress=False, device="cpu")
    t = _table(ds.graph.num_nodes, 32, seed=9)  # 128-byte rows
    write_table(tmp_path / "f.npy", t)
    costs = DiskCosts(iops=50_000, seq_GBps=1.0)
    fs = FeatureStore(tmp_path / "f.npy", gpu_cache=0, host_memory=host, hotness=ds.graph,
                      disk=DiskOptions(superbatch=superbatch, buffers=buffers, costs=costs, **SMALL))
    return ds, t, fs


@pytest.mark.slow
@pytest.mark.parametrize("buffers", [1, 2])
def test_superbatches_serve_every_batch_from_staging(tmp_path, buffers: int) -> None:
    pct = 30 * buffers  # every batch's disk rows fit a buffer
    ds, t, fs = _graph_store(tmp_path, f"{pct}%", buffers, host="95%")
    assert fs.tiers()["disk"]["staging_bytes"] == (fs.nbytes * pct // 100) // buffers * buffers + \
        BOUNCE_BUFFERS * (128 << 10)
    loader = NeighborLoader(ds.graph, ds.train_idx, [10, 5], 256, shuffle=True, features=fs, labels=ds.labels,
                            device="cpu", prefetch=2)
    disk_rows = 0
    for b in loader:
        assert torch.equal(b.x, t[b.input_nodes])
        disk_rows += int((fs._slots[b.input_nodes] < 0).sum())
    st = fs.stats()["disk"]
    supers = st["superbatches"]
    assert len(supers) >= 2 and sum(s["batches"] for s in supers) == len(loader)
    assert sum(s["skipped"] for s in supers) == 0
    assert st["staged_rows"] == st["rows"] == disk_rows and st["staged_missing"] == 0
    assert sum(s["rows"] for s in supers) < disk_rows  # a row several batches need is read once per superbatch
    assert all(s["rows"] * 128 <= (fs.nbytes * pct // 100) // buffers for s in supers)
    assert st["read_bytes"] == sum(s["read_bytes"] for s in supers) and st["io_seconds"] > 0
    n = len(supers)
    it = iter(loader)  # a later epoch's superbatches do not change the stats taken before
    b = next(it)
    assert torch.equal(b.x, t[b.input_nodes])
    it.close()
    assert len(st["superbatches"]) == n and len(fs.stats()["disk"]["superbatches"]) > n
    assert {s["mode"] for s in supers} <= {"pages", "scan"} | {f"gaps<={g}" for g in GAPS}
    fs.close()


@pytest.mark.slow
def test_an_abandoned_epoch_and_other_loaders(tmp_path) -> None:
    ds, t, fs = _graph_store(tmp_path, "30%")
    loader = NeighborLoader(ds.graph, ds.train_idx, [10, 5], 256, shuffle=True, features=fs, device="cpu")
    it = iter(loader)
    for _ in range(3):
        b = next(it)
        assert torch.equal(b.x, t[b.input_nodes])
    it.close()  # the schedule stops and hands its buffers back
    other = NeighborLoader(ds.graph, ds.val_idx, [10, 5], 128, features=fs, device="cpu", prefetch=0)
    for b in other:  # no schedule: rows read batch by batch
        assert torch.equal(b.x, t[b.input_nodes])
    n = 0
    for b in loader:  # the next epoch gets the staging buffer again
        assert torch.equal(b.x, t[b.input_nodes])
        n += 1
    assert n == len(loader)
    fs.close()


def test_a_read_error_in_a_superbatch_names_the_file_and_offset(tmp_path) -> None:
    ds, t, fs = _graph_store(tmp_path, "30%")
    p = tmp_path / "f.npy"
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 256 * 1024)
    loader = NeighborLoader(ds.graph, ds.train_idx, [10, 5], 256, features=fs, device="cpu")
    with pytest.raises(DiskReadError, match=r"reading .*f\.npy at offset \d+ failed: short read") as err:
        for _ in loader:
            pass
    assert err.value.filename.endswith("f.npy")
    fs.close()


def test_superbatch_options_are_checked(tmp_path) -> None:
    write_table(tmp_path / "f.npy", _table(20_000, 32))
    with pytest.raises(FeatureStoreError, match="disk.superbatch='50%' needs .* but host_memory is"):
        FeatureStore(tmp_path / "f.npy", host_memory="40%", disk=DiskOptions(superbatch="50%", **SMALL))
    with pytest.raises(FeatureStoreError, match="disk.buffers must be 1 or 2"):
        FeatureStore(tmp_path / "f.npy", host_memory="60%", disk=DiskOptions(superbatch="20%", buffers=3, **SMALL))
    with pytest.raises(FeatureStoreError, match="disk.superbatch='lots' does not parse"):
        FeatureStore(tmp_path / "f.npy", host_memory="60%", disk=DiskOptions(superbatch="lots"))
    for fs in (FeatureStore(tmp_path / "f.npy", host_memory="100%"),  # every row in host memory
               FeatureStore(tmp_path / "f.npy", host_memory="50%")):  # no superbatch staging
        assert fs.schedule([0], lambda k: torch.arange(5)) is None
