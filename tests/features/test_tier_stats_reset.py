"""A reset of the statistics while a fetch tier works loses no count and brings none back: what every
`FeatureStore.reset_stats` returned plus the statistics at the end add up to what was moved, for the sharded store's
remote tier (2 gloo processes, a thread resetting while the exchanges run) and the disk tier (each fetch falls wholly
in one reset's statistics)."""
from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch
from datapath.features import FeatureStore, sharded_store
from datapath.graph import ShardLayout

N, F = 800, 3
INTS = ("exchanges", "timed_exchanges", "received_rows", "received_bytes", "sent_rows", "sent_bytes", "id_bytes",
        "rows", "bytes")


def _table() -> torch.Tensor:
    return torch.randn(N, F, dtype=torch.float64, generator=torch.Generator().manual_seed(8))


def _resetting(run: Any, store: FeatureStore) -> list[dict]:
    """``run()`` while a thread calls ``stats()`` and ``reset_stats()`` without pause; what every reset returned."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave as finely as the interpreter allows
    stop = threading.Event()
    cleared: list[dict] = []

    def resetter() -> None:
        while not stop.is_set():
            store.stats()
            cleared.append(store.reset_stats())

    t = threading.Thread(target=resetter, daemon=True)
    t.start()
    try:
        run()
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    return cleared


def _exchanges_while_resetting(steps: int) -> dict:
    """``steps`` gathers of random rows (each an exchange) while another thread resets the statistics; the remote
    tier's statistics of every reset and at the end, and what this rank asked for."""
    ctx = init_distributed("cpu")
    torch.set_num_threads(1)
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    store = sharded_store(_table()[lo:hi], layout, device="cpu", piece_bytes=256)
    g = torch.Generator().manual_seed(60 + ctx.rank)
    asks = [torch.randint(0, N, (int(torch.randint(0, 40, (), generator=g)),), generator=g) for _ in range(steps)]
    equal = []

    def run() -> None:
        for ids in asks:
            equal.append(torch.equal(store.gather(ids), _table()[ids]))

    cleared = _resetting(run, store)
    final = store.stats()["remote"]
    dist.barrier()
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, asks)
    return {"cleared": [c["remote"] for c in cleared], "final": final, "every": every, "lo_hi": (lo, hi),
            "equal": equal}


@pytest.mark.slow  # about 5 s: two processes
def test_sharded_tier_reset_while_exchanging_loses_and_resurrects_nothing() -> None:
    steps = 200
    res = launch(_exchanges_while_resetting, 2, (steps,))
    for r, out in enumerate(res):
        assert all(out["equal"]) and len(out["equal"]) == steps
        assert len(out["cleared"]) > 10, len(out["cleared"])  # the resets ran while the exchanges did
        lo, hi = out["lo_hi"]
        own = torch.zeros(N, dtype=torch.bool)
        own[lo:hi] = True
        mine = torch.cat(out["every"][r])
        others = torch.cat([torch.cat(o["every"][q]) for q, o in enumerate(res) if q != r])
        received, sent = int((~own[mine]).sum()), int(own[others].sum())
        row_bytes = F * 8
        want = {"exchanges": steps, "timed_exchanges": steps, "received_rows": received,
                "received_bytes": received * row_bytes, "sent_rows": sent, "sent_bytes": sent * row_bytes,
                "rows": received, "bytes": received * row_bytes}
        got = {k: sum(c[k] for c in out["cleared"]) + out["final"][k] for k in INTS}
        assert {k: got[k] for k in want} == want, (r, got, want)
        assert got["id_bytes"] == (received + sent) * 4, (r, got)  # int32 row numbers, both ways
        assert all(c[k] >= 0 for c in out["cleared"] for k in INTS)


def test_disk_tier_reset_while_fetching_splits_no_fetch(tmp_path: Any) -> None:
    """Every fetch of the same rows adds the same rows, reads and bytes read: each reset's statistics hold whole
    fetches (no fetch's rows in one reset and its reads in the next), and they add up to every fetch made."""
    table = _table()
    path = tmp_path / "f.npy"
    np.save(path, table.numpy())
    store = FeatureStore(path, gpu_cache=0, host_memory=0, device="cpu")
    assert store.tiers()["disk"]["rows"] == N
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(3))[:50]
    store.gather(ids)
    one = store.reset_stats()["disk"]
    assert one["rows"] == 50 and one["reads"] > 0 and one["read_bytes"] > 0
    steps = 400
    equal = []

    def run() -> None:
        for _ in range(steps):
            equal.append(torch.equal(store.gather(ids), table[ids]))

    cleared = [c["disk"] for c in _resetting(run, store)] + [store.stats()["disk"]]
    store.close()
    assert all(equal) and len(equal) == steps
    assert len(cleared) > 10, len(cleared)
    for c in cleared:
        fetches = c["rows"] // one["rows"]
        whole = {k: c[k] for k in ("rows", "bytes", "reads", "read_bytes")}
        assert whole == {k: fetches * one[k] for k in whole}, (c, one)
    for k in ("rows", "bytes", "reads", "read_bytes"):
        assert sum(c[k] for c in cleared) == steps * one[k], k
