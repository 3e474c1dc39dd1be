"""The sharded feature store against the whole table: 2 and 3 gloo processes, each holding one shard."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from datapath.apps import DistributedError, init_distributed, launch
from datapath.features import FeatureStore, FeatureStoreError, new_exchange_group, sharded_store
from datapath.graph import DatasetError, ShardLayout, SyntheticSpec, generate, load_dataset, shard_file
from datapath.loaders import DistributedNeighborLoader, NeighborLoader

N, F = 1000, 7


def _table() -> torch.Tensor:
    return torch.randn(N, F, generator=torch.Generator().manual_seed(1))


def _batches(rank: int) -> list[torch.Tensor]:
    """Random ids (repeats, negatives, 2-D) of uneven sizes; some ranks ask for nothing in some steps."""
    g = torch.Generator().manual_seed(10 + rank)
    sizes = [0, 5, 300, 1, 0, 1000, 64]
    out = [torch.randint(-N, N, (sizes[(i + rank) % len(sizes)],), generator=g) for i in range(len(sizes))]
    out.append(torch.randint(0, N, (9, 4), generator=g))
    out.append(torch.zeros(0, dtype=torch.int64))  # every rank empty at once
    return out


def _fetch_like_the_table() -> dict:
    ctx = init_distributed("cpu")
    table = _table()
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    hot = torch.rand(N, generator=torch.Generator().manual_seed(2))  # the same scores on every rank
    store = sharded_store(table[lo:hi], layout, gpu_cache="20%", hotness=hot, device="cpu")
    equal = []
    for idx in _batches(ctx.rank):
        got = store[idx]
        equal.append(got.shape == (*idx.shape, F) and torch.equal(got, table[idx]))
    stats = store.stats()
    # rows of other shards the batches found in this rank's GPU cache (the 200 hottest of the whole table)
    hot_ids = torch.argsort(hot, descending=True, stable=True)[:200]
    is_cached = torch.zeros(N, dtype=torch.bool)
    is_cached[hot_ids] = True
    remote_hits = 0
    for idx in _batches(ctx.rank):
        ids = torch.where(idx < 0, idx + N, idx).reshape(-1)
        remote_hits += int((is_cached[ids] & ((ids < lo) | (ids >= hi))).sum())
    stats["expected_remote_cache_rows"] = remote_hits
    cached = store._cache  # noqa: SLF001 - which rows the cache holds, checked against the hotness order
    cache_ok = torch.equal(cached, table[torch.argsort(hot, descending=True, stable=True)[:200]])
    try:  # rank 1 asks for a row that does not exist: every rank raises, none waits
        store[torch.tensor([3, N + 5] if ctx.rank == 1 else [1, 2])]
        error = None
    except Exception as exc:  # noqa: BLE001 - the test reads it
        error = (type(exc).__name__, str(exc))
    after = torch.equal(store[torch.arange(N).flip(0)], table.flip(0))  # the exchange still pairs up
    # a cache of this rank's own hottest rows: the other ranks' requests for them are served from it
    own = sharded_store(table[lo:hi], layout, gpu_cache="20%", hotness=hot, cache_scope="own", device="cpu",
                        piece_bytes=300)  # rows sent in up to 8 pieces, each gathered while the previous one goes
    equal += [torch.equal(own[idx], table[idx]) for idx in _batches(ctx.rank)]
    mine = torch.argsort(hot[lo:hi], descending=True, stable=True)[:200] + lo
    equal.append(torch.equal(own._cache, table[mine]))  # noqa: SLF001
    return {"equal": equal, "stats": stats, "tiers": store.tiers(), "cache_ok": cache_ok, "error": error,
            "after": after, "lo_hi": (lo, hi), "own": own.stats()["remote"]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rows_of_the_whole_table(world: int) -> None:
    t0 = time.perf_counter()
    res = launch(_fetch_like_the_table, world)
    assert time.perf_counter() - t0 < 90
    for r, out in enumerate(res):
        assert all(out["equal"]), (r, out["equal"])
        assert out["cache_ok"] and out["after"]
        lo, hi = out["lo_hi"]
        tiers = out["tiers"]
        assert tiers["host"]["rows"] == hi - lo and tiers["gpu_cache"]["rows"] == 200
        st = out["stats"]
        asked = sum(int(np.prod(i.shape)) for i in _batches(r))
        assert st["gpu_cache"]["rows"] + st["host"]["rows"] + st["remote"]["rows"] == asked
        assert st["remote"]["exchanges"] == len(_batches(r)) and 0.2 < st["remote"]["hit_rate"] < 0.9
        assert st["remote"]["received_bytes"] == st["remote"]["received_rows"] * F * 4 > 0
        # rows of other shards the cache holds are not fetched: remote rows = distinct uncached rows of others
        assert st["remote"]["received_rows"] <= st["remote"]["rows"]
        assert st["remote"]["remote_cache_rows"] == st["expected_remote_cache_rows"] > 0
        assert out["own"]["remote_cache_rows"] == 0  # a cache of its own shard holds no other rank's row
        # each stage's time is reported, and they add up to the tier's time (host time on a CPU)
        rem = st["remote"]
        assert min(rem["counts_seconds"], rem["ids_seconds"], rem["exchange_seconds"]) > 0
        assert abs(rem["counts_seconds"] + rem["ids_seconds"] + rem["exchange_seconds"] - rem["seconds"]) < 1e-6
        assert rem["wall_seconds"] >= rem["seconds"]
        # every cache holds the same rows ("any"): nothing asked of a rank is in its cache; "own": some are
        assert st["remote"]["sent_from_cache_rows"] == 0 < out["own"]["sent_from_cache_rows"] <= out["own"]["sent_rows"]
        name, msg = out["error"]
        if r == 1:
            assert name == "IndexError" and str(N + 5) in msg
        else:
            assert name == "ShardExchangeError" and f"rank {r} of {world} stops: rank 1 could not fetch" in msg
    # every rank served what the others received
    assert sum(o["stats"]["remote"]["sent_rows"] for o in res) == sum(o["stats"]["remote"]["received_rows"] for o in res)


def _loader_beside_all_reduce() -> list[bool]:
    """The loader's producer thread exchanges rows while this thread all-reduces on the default group (as DDP)."""
    ctx = init_distributed("cpu")
    ds = generate(SyntheticSpec("s", 2000, 12_000, 12, 4, seed=3), device="cpu", progress=False)
    layout = ShardLayout.even(ds.graph.num_nodes, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    store = sharded_store(ds.features[lo:hi], layout, device="cpu", piece_bytes=4096)
    loader = DistributedNeighborLoader(ds.graph, ds.train_idx, [5, 3], 64, shuffle=True, rank=ctx.rank,
                                       world_size=ctx.world_size, features=store, labels=ds.labels, device="cpu",
                                       prefetch=2, max_steps=6)
    ok = []
    for epoch in range(2):
        for i, batch in enumerate(loader):
            if epoch == i == 0:  # the producer thread exchanges the next batches' rows while this one waits
                deadline = time.monotonic() + 20
                while store.stats()["remote"]["exchanges"] < 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                ok.append(store.stats()["remote"]["exchanges"] >= 3)
                # ... on a stage of their own, while the worker samples (the collective store's exchange stage)
                ok.append(any(t.name == "datapath-neighbor-loader-exchange" for t in threading.enumerate()))
            grad = torch.ones(1000) * (ctx.rank + 1)
            dist.all_reduce(grad)
            ok.append(torch.equal(batch.x, ds.features[batch.input_nodes]) and bool((grad == 3).all()))
    return ok


@pytest.mark.slow
def test_loader_exchanges_in_its_producer_thread_beside_all_reduce() -> None:
    for ok in launch(_loader_beside_all_reduce, 2):
        assert ok == [True] * 14


def _bad_shard() -> None:
    init_distributed("cpu")
    rank = dist.get_rank()
    layout = ShardLayout.even(N, 2)
    lo, hi = layout.rows(rank)
    sharded_store(_table()[lo:hi - (3 if rank == 1 else 0)], layout, device="cpu")


@pytest.mark.slow
def test_a_shard_of_the_wrong_size_stops_every_rank_naming_it() -> None:
    t0 = time.perf_counter()
    with pytest.raises(DistributedError, match=r"(?s)rank 1: its shard has shape \(497, 7\).*rows 500\.\.999"):
        launch(_bad_shard, 2, grace_period=1.0)
    assert time.perf_counter() - t0 < 60


def test_one_rank_store_and_arguments() -> None:
    table = _table()
    one = sharded_store(table, ShardLayout.even(N, 1), gpu_cache="10%", hotness=torch.rand(N), device="cpu")
    assert isinstance(one, FeatureStore) and torch.equal(one[torch.arange(N)], table)
    with pytest.raises(FeatureStoreError, match="2 shards needs a torch.distributed job"):
        sharded_store(table[:500], ShardLayout.even(N, 2), device="cpu")


def test_layout() -> None:
    lay = ShardLayout.even(10, 3)
    assert lay.bounds == (0, 3, 6, 10) and lay.shards == 3 and lay.rows(2) == (6, 10) and lay.size(0) == 3
    assert ShardLayout.even(2, 3).bounds == (0, 0, 1, 2)  # a shard may be empty
    for bad in ((1, 5), (0, 5, 3), (0,)):
        with pytest.raises(DatasetError, match="bounds"):
            ShardLayout(bad)
    with pytest.raises(DatasetError, match="integer >= 1"):
        ShardLayout.even(10, 0)
    with pytest.raises(DatasetError, match="shard 3 does not exist"):
        lay.rows(3)


def test_sharded_dataset_files(tmp_path: Path) -> None:
    ds = generate(SyntheticSpec("s", 900, 5000, 6, 3, seed=2), device="cpu", progress=False)
    d = ds.save(tmp_path / "d", shards=3)
    names = sorted(p.name for p in d.iterdir())
    assert "features.npy" not in names and [shard_file(r, 3) for r in range(3)] == [n for n in names if "shard" in n]
    meta = json.loads((d / "meta.json").read_text())
    assert meta["feature_shards"]["bounds"] == [0, 300, 600, 900]
    whole = load_dataset(d)
    assert torch.equal(whole.features, ds.features) and whole.feature_shard is None
    for r in range(3):
        (d / shard_file((r + 1) % 3, 3)).rename(tmp_path / "away.npy")  # a machine holds only its shard
        part = load_dataset(d, shard=(r, 3))
        assert part.feature_shard == r and part.feature_layout.rows(r) == (300 * r, 300 * r + 300)
        assert torch.equal(part.features, ds.features[300 * r:300 * r + 300])
        assert torch.equal(part.graph.indices, ds.graph.indices) and torch.equal(part.labels, ds.labels)
        (tmp_path / "away.npy").rename(d / shard_file((r + 1) % 3, 3))
    with pytest.raises(DatasetError, match=r"in 3 shards .* but the job has 2 ranks"):
        load_dataset(d, shard=(0, 2))
    (d / shard_file(1, 3)).unlink()
    with pytest.raises(DatasetError, match=r"features.shard-1-of-3.npy is missing: shard 1 of 3 .* rank 1"):
        load_dataset(d, shard=(1, 3))
    assert load_dataset(d, shard=(2, 3)).features.shape == (300, 6)
    np.save(d / shard_file(1, 3), np.zeros((6, 300), np.float32))  # as many bytes, another shape
    with pytest.raises(DatasetError, match=r"shape \(6, 300\), but shard 1 of 3 must hold rows 300\.\.599"):
        load_dataset(d, shard=(1, 3))
    # a directory with one features.npy: a rank reads its rows of it
    flat = ds.save(tmp_path / "flat")
    part = load_dataset(flat, shard=(1, 2))
    assert torch.equal(part.features, ds.features[450:]) and part.feature_layout.bounds == (0, 450, 900)
    with pytest.raises(DatasetError, match="only a whole dataset can be saved"):
        part.save(tmp_path / "again")


def test_one_process_loader_over_a_one_rank_store() -> None:
    ds = generate(SyntheticSpec("s", 600, 3000, 5, 3, seed=1), device="cpu", progress=False)
    store = sharded_store(ds.features, ShardLayout.even(600, 1), device="cpu")
    for b in NeighborLoader(ds.graph, ds.train_idx, [4, 2], 50, features=store, device="cpu", prefetch=1):
        assert torch.equal(b.x, ds.features[b.input_nodes])
