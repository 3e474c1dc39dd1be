"""`FeatureStore.stats` and `reset_stats` read (and zero) the counters while a loader's producer threads gather:
the counts of every tier add up to the rows the batches asked for, none lost between a read and a reset (CPU; the
GPU form at the end)."""
from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

from datapath.features import FeatureStore
from datapath.features.hotness import rank
from datapath.graph import SyntheticSpec, generate
from datapath.loaders import NeighborLoader

SPEC = SyntheticSpec("s", 3000, 18000, 6, 4, seed=11)
TIERS = ("gpu_cache", "host", "disk")
EPOCHS = 2


def _run(tmp_path: Any, device: str, reset_every: int) -> tuple[list[dict], dict, torch.Tensor, FeatureStore]:
    """`EPOCHS` epochs of a loader (2 producer threads, prefetching) over a store with a cache, a host tier and a
    disk tier, while a reader thread calls ``stats()`` without pause; the training thread calls ``reset_stats()``
    after every ``reset_every`` batches (0: never).  Returns what each reset cleared, the statistics at the end,
    every row the batches asked for, and the store."""
    ds = generate(SPEC, device="cpu", progress=False)
    path = tmp_path / "f.npy"
    np.save(path, ds.features.numpy())
    hot = torch.rand(SPEC.num_nodes, generator=torch.Generator().manual_seed(2))
    store = FeatureStore(path, gpu_cache="10%", host_memory="30%", hotness=hot, device=device)
    loader = NeighborLoader(ds.graph, ds.train_idx, [4, 3], 8, shuffle=True, seed=5, features=store, device=device,
                            prefetch=3, num_workers=2)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave as finely as the interpreter allows
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            store.stats()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    cleared, asked = [], []
    try:
        for k, batch in enumerate((b for _ in range(EPOCHS) for b in loader), 1):
            asked.append(batch.input_nodes.cpu())
            assert torch.equal(batch.x.cpu(), ds.features[batch.input_nodes.cpu()])
            if reset_every and k % reset_every == 0:
                cleared.append(store.reset_stats())
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    if device == "cuda":
        torch.cuda.synchronize()
    return cleared, store.stats(), torch.cat(asked), store


def _tier_of(store: FeatureStore, hot: torch.Tensor) -> torch.Tensor:
    """(N,) 0/1/2: the tier (`TIERS`) each row lives in (the hottest in the cache, the next in host memory)."""
    t = store.tiers()
    c, h = t["gpu_cache"]["rows"], t["host"]["rows"]
    assert c > 0 and h > 0 and t["disk"]["rows"] > 0
    where = torch.full((store.num_rows,), 2, dtype=torch.int64)
    order = rank(hot)
    where[order[:c]] = 0
    where[order[c:c + h]] = 1
    return where


def _check(tmp_path: Any, device: str, reset_every: int) -> None:
    cleared, final, asked, store = _run(tmp_path, device, reset_every)
    try:
        hot = torch.rand(SPEC.num_nodes, generator=torch.Generator().manual_seed(2))
        per_tier = torch.bincount(_tier_of(store, hot)[asked], minlength=3).tolist()
        assert min(per_tier) > 0, per_tier
        assert all(isinstance(p, dict) for p in cleared), cleared  # every reset returns what it cleared
        parts = [*cleared, final]
        for name, want in zip(TIERS, per_tier):
            got = sum(p[name]["rows"] for p in parts)
            assert got == want, (name, got, want, [p[name]["rows"] for p in parts])
            assert sum(p[name]["bytes"] for p in parts) == want * store.row_bytes, name
        # each statistics' hit rates are shares of its own rows
        for p in parts:
            if sum(p[n]["rows"] for n in TIERS):
                assert sum(p[n]["hit_rate"] for n in TIERS) == pytest.approx(1.0)
        if reset_every:  # resets cleared counts while the producers gathered (a reset that follows batches the
            # producers gathered before the last reset finds none: the loader runs ahead)
            assert sum(sum(p[n]["rows"] for n in TIERS) > 0 for p in cleared) >= 3, cleared
    finally:
        store.close()


@pytest.mark.parametrize("reset_every", [0, 4])
def test_counts_read_and_reset_while_the_loader_gathers_lose_nothing(tmp_path, reset_every: int) -> None:
    """``stats()`` read without pause by another thread (and ``reset_stats()`` every few batches by the training
    thread, each returning what it cleared) while 2 producer threads gather: the rows of each tier, summed over the
    resets and the final statistics, are the rows the batches asked of it."""
    _check(tmp_path, "cpu", reset_every)


@pytest.mark.gpu
@pytest.mark.parametrize("reset_every", [0, 4])
def test_gpu_counts_read_and_reset_while_the_loader_gathers_lose_nothing(tmp_path, reset_every: int) -> None:
    """The same on CUDA: the gathers' counters are written by the tiered kernel on the producers' streams."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(tmp_path, "cuda", reset_every)
