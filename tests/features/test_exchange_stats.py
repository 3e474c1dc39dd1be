"""The statistics of a sharded store's exchange (`ShardedTier.stats`): every exchange records every stage, also one
where no rank asks for a row, and the counters read while the loader's exchange thread runs lose nothing (2 gloo
processes; the GPU form at the end)."""
from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch
from datapath.features import new_exchange_group, sharded_store
from datapath.features.exchange import ShardedTier
from datapath.graph import ShardLayout, SyntheticSpec, generate
from datapath.loaders import DistributedNeighborLoader

N, F = 600, 5


def _table() -> torch.Tensor:
    return torch.randn(N, F, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _requests(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s requests: some where no rank asks for anything (every rank empty at once), some where only
    this rank asks, some of its own shard only (an exchange of no remote row, but rows of its own)."""
    g = torch.Generator().manual_seed(30 + rank)
    empty = torch.zeros(0, dtype=torch.int64)
    return [empty, torch.randint(0, N, (50,), generator=g), empty, empty,
            torch.randint(0, N, (7,), generator=g) if rank == 0 else empty, empty,
            torch.randint(0, N, (200,), generator=g), empty]


def _stage_times(device: str) -> list[dict]:
    """After each exchange of `_requests`: the tier's statistics (its stage times folded in)."""
    ctx = init_distributed("cpu")  # on CUDA too: the ranks share one GPU, the exchange goes over gloo
    dev = torch.device(device if device == "cpu" else "cuda", 0 if device == "cuda" else None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    tier = ShardedTier(_table()[lo:hi], layout, ctx.rank, new_exchange_group(backend="gloo"), dev, piece_bytes=256)
    out = []
    for ids in _requests(ctx.rank):
        rows = tier.exchange(ids.to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        st = tier.stats.as_dict(1)
        st["equal"] = torch.equal(rows.cpu(), _table()[ids])
        out.append(st)
    return out


def _check_stage_times(res: list[list[dict]]) -> None:
    for r, after in enumerate(res):
        assert all(st["equal"] for st in after), r
        prev: dict = {"counts_seconds": 0.0, "seconds": 0.0}
        for k, st in enumerate(after, 1):
            # every exchange is timed, also where no rank asks for a row (no ids or rows all_to_all): its sort and
            # counts all_gather
            assert st["counts_seconds"] > prev["counts_seconds"], (r, k, st)
            assert st["seconds"] > prev["seconds"], (r, k, st)
            assert st["exchanges"] == st["timed_exchanges"] == k, (r, k, st)
            # the stages add up to the tier's time
            assert st["counts_seconds"] + st["ids_seconds"] + st["exchange_seconds"] == pytest.approx(st["seconds"])
            prev = st


@pytest.mark.slow
def test_every_exchange_records_its_stages_also_with_nothing_asked() -> None:
    _check_stage_times(launch(_stage_times, 2, ("cpu",)))


@pytest.mark.gpu
def test_gpu_every_exchange_records_its_stages_also_with_nothing_asked() -> None:
    """One GPU, two ranks (gloo): the exchanges where nothing is asked record their counts stage too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_stage_times(launch(_stage_times, 2, ("cuda",)))


SPEC = SyntheticSpec("s", 1500, 9000, 6, 4, seed=7)


def _counters_while_reading(scope: str, steps: int) -> dict:
    """An epoch of ``steps`` batches whose rows the loader's exchange thread fetches while another thread reads the
    statistics without pause (and the training thread after every batch); the remote tier's counters at the end
    and what every rank's batches asked for."""
    ctx = init_distributed("cpu")
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-6)  # the threads interleave as finely as the interpreter allows
    ds = generate(SPEC, device="cpu", progress=False)
    n = ds.graph.num_nodes
    layout = ShardLayout.even(n, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    hot = torch.rand(n, generator=torch.Generator().manual_seed(5))  # the same on every rank
    store = sharded_store(ds.features[lo:hi], layout, gpu_cache="30%", hotness=hot, cache_scope=scope,
                          device="cpu", piece_bytes=512)
    slots = store._slots  # noqa: SLF001 - which rows this rank's cache holds: slots 1..c
    cached = ((slots >= 1) & (slots <= store.cache_rows)).nonzero().squeeze(1)
    loader = DistributedNeighborLoader(ds.graph, ds.train_idx, [4, 3], 4, shuffle=True, rank=ctx.rank,
                                       world_size=ctx.world_size, features=store, labels=ds.labels, device="cpu",
                                       prefetch=2, max_steps=steps)
    stop = threading.Event()

    def reader() -> None:  # the statistics read without pause (each read folds what the exchanges counted)
        while not stop.is_set():
            store.stats()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    inputs, equal = [], []
    try:
        for batch in loader:
            inputs.append(batch.input_nodes.clone())
            equal.append(torch.equal(batch.x, ds.features[batch.input_nodes]))
            store.stats()  # and by the training thread, as a progress log does
            dist.all_reduce(torch.ones(1))
    finally:
        stop.set()
        t.join(30)
    total = store.stats()["remote"]
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, inputs)
    return {"total": total, "every": every, "cached": cached, "lo_hi": (lo, hi), "equal": equal}


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["any", "own"])
def test_counters_read_while_the_exchange_thread_runs_lose_nothing(scope: str) -> None:
    """The remote tier's counters, read without pause while the exchange thread counts, add up to what
    every batch moved: rows found in the rank's cache (``any``: other shards' rows it holds) and rows it served
    the other ranks from its cache (``own``)."""
    steps = 80
    res = launch(_counters_while_reading, 2, (scope, steps))
    for r, out in enumerate(res):
        assert all(out["equal"]) and len(out["equal"]) == steps
        lo, hi = out["lo_hi"]
        cached = torch.zeros(SPEC.num_nodes, dtype=torch.bool)
        cached[out["cached"]] = True
        own = torch.zeros(SPEC.num_nodes, dtype=torch.bool)
        own[lo:hi] = True
        mine = torch.cat(out["every"][r])
        others = torch.cat([torch.cat(o["every"][q]) for q, o in enumerate(res) if q != r])
        total = out["total"]
        assert total["exchanges"] == steps
        assert total["received_rows"] == int((~own[mine] & ~cached[mine]).sum())
        assert total["remote_cache_rows"] == int((~own[mine] & cached[mine]).sum())
        # rows the other ranks asked of this one (those their own stores lack) that its cache served
        if scope == "own":
            assert total["sent_from_cache_rows"] == int((own[others] & cached[others]).sum()) > 0
        else:  # every cache holds the same rows: nothing asked of this rank is in its cache
            assert total["sent_from_cache_rows"] == 0 < total["remote_cache_rows"]
