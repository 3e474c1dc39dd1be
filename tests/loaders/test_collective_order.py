"""The order of a rank's collectives: a sharded store's exchanges (loader thread) and DDP's all-reduce (training
thread) are submitted in the same order on every rank, whatever the threads' timing (`datapath.loaders.CollectiveOrder`)."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch, train_epoch
from datapath.apps.train_gnn import global_mean_loss, wrap_ddp
from datapath.features import sharded_store
from datapath.graph import ShardLayout, SyntheticSpec, generate
from datapath.loaders import CollectiveOrder, DistributedNeighborLoader, NeighborLoader
from datapath.memory import to_placement
from datapath.nn.models import build_model

STEPS, BATCH, PREFETCH = 9, 24, 2
SPEC = SyntheticSpec("s", 1200, 8000, 8, 4, seed=5)


def _canonical(total: int, ahead: int) -> str:
    """X: an exchange, A: a step's all-reduce: X(0..A), then A(k) X(k + A + 1), then the last steps."""
    return "X" * (ahead + 1) + "AX" * (total - ahead - 1) + "A" * (ahead + 1)


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_two_threads_take_turns_in_the_canonical_order(ahead: int) -> None:
    """An exchange thread and a consumer with random delays: the order of their turns is fixed by the batch numbers."""
    total = 12
    for trial in range(5):
        rng = random.Random(trial * 10 + ahead)
        delays = [(rng.random() * 0.004, rng.random() * 0.004) for _ in range(total)]
        order = CollectiveOrder(total, ahead, threading.Event())
        log: list[str] = []

        def exchange() -> None:
            try:
                for j in range(total):
                    time.sleep(delays[j][0])
                    assert order.exchange_turn(j)
                    log.append("X")
                    order.exchanged(j)
            finally:
                order.end()

        t = threading.Thread(target=exchange)
        t.start()
        for k in range(total):
            order.consumer_turn(k)
            time.sleep(delays[k][1])
            log.append("A")
        t.join(10)
        assert "".join(log) == _canonical(total, ahead), trial


def test_a_stop_or_an_end_releases_every_wait() -> None:
    stop = threading.Event()
    order = CollectiveOrder(5, 1, stop)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(order.exchange_turn(4)))
    t.start()
    time.sleep(0.2)
    assert not done  # batch 4's exchange is not released before the consumer asks for batch 3
    stop.set()
    t.join(2)
    assert done == [False]  # stopped: the exchange thread submits nothing
    order = CollectiveOrder(5, 2, threading.Event())
    t0 = time.perf_counter()
    threading.Timer(0.2, order.end).start()
    order.consumer_turn(0)  # nothing was exchanged; the exchange thread ends (its error reaches the queue)
    assert 0.15 < time.perf_counter() - t0 < 5
    with pytest.raises(ValueError, match="ahead must be >= 0"):
        CollectiveOrder(3, -1, threading.Event())


def _ordered_training(jitter_s: float, device: str = "cpu") -> dict:
    """This rank trains through `train_epoch` with DDP over a sharded store, logging every collective it submits.

    The loader's exchange thread and the training thread sleep at random (per rank) between their collectives.
    ``device="cuda"``: one GPU per rank, NCCL for both groups.
    """
    ctx = init_distributed(device)
    torch.set_num_threads(1)
    dev = ctx.device
    ds = generate(SPEC, device="cpu", progress=False)
    graph, labels = (ds.graph, ds.labels) if dev.type == "cpu" else (ds.graph.to("unified"),
                                                                    to_placement(ds.labels, "cuda"))
    layout = ShardLayout.even(ds.graph.num_nodes, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    store = sharded_store(ds.features[lo:hi], layout, device=dev, piece_bytes=1024)
    log: list[str] = []
    import datapath.features.exchange as exchange  # noqa: PLC0415 - the spies wrap the real collectives
    real_gather, real_all_to_all = exchange._all_gather, dist.all_to_all_single  # noqa: SLF001

    def counts(*a, **k):  # the first collective of every exchange
        log.append("X")
        return real_gather(*a, **k)

    def all_to_all(*a, **k):
        log.append("x")
        return real_all_to_all(*a, **k)

    exchange._all_gather = counts  # noqa: SLF001
    dist.all_to_all_single = all_to_all
    rng = random.Random(1000 + ctx.rank)

    def jitter(batch):  # runs on the exchange thread, after each exchange
        time.sleep(rng.random() * jitter_s)

    loader = DistributedNeighborLoader(graph, ds.train_idx, [5, 3], BATCH, shuffle=True, rank=ctx.rank,
                                       world_size=ctx.world_size, features=store, labels=labels, device=dev,
                                       prefetch=PREFETCH, max_steps=STEPS, prepare=jitter)
    torch.manual_seed(0)
    model = wrap_ddp(build_model("sage", ds.num_features, 16, ds.num_classes, 2, dropout=0.0).to(dev), ctx)

    def hook(state, bucket):  # DDP's all-reduce of a bucket of gradients, as the default hook does it
        if bucket.index() == 0:
            log.append("A")
        t = bucket.buffer().div_(ctx.world_size)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    mean_loss = global_mean_loss(ctx.world_size)
    train_rng = random.Random(2000 + ctx.rank)

    def loss_fn(out, batch):  # the training thread's own delays, between forward and backward
        time.sleep(train_rng.random() * jitter_s)
        return mean_loss(out, batch)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        log.append("|")
        losses += train_epoch(model, loader, opt, loss_fn=loss_fn).losses
    exchange._all_gather, dist.all_to_all_single = real_gather, real_all_to_all  # noqa: SLF001
    return {"log": "".join(log), "losses": losses}


def _reference_losses() -> list[float]:
    """One process, the whole table, the global batch: the losses the ranks' job must reproduce."""
    ds = generate(SPEC, device="cpu", progress=False)
    loader = NeighborLoader(ds.graph, ds.train_idx, [5, 3], BATCH * WORLD, shuffle=True, features=ds.features,
                            labels=ds.labels, device="cpu", prefetch=PREFETCH)
    torch.manual_seed(0)
    model = build_model("sage", ds.num_features, 16, ds.num_classes, 2, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return [x for _ in range(2) for x in train_epoch(model, loader, opt, max_batches=STEPS).losses]


WORLD = 2


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_submits_its_collectives_in_the_same_order(world: int) -> None:
    res = launch(_ordered_training, world, (0.03,))
    logs = [r["log"] for r in res]
    for r, lg in enumerate(logs):  # identical on every rank, and the order the schedule names
        assert lg == logs[0], f"rank {r}'s collectives came in another order than rank 0's:\n{lg}\n{logs[0]}"
    for epoch in logs[0].split("|")[1:]:
        assert epoch.replace("x", "") == _canonical(STEPS, PREFETCH), epoch
    if world == WORLD:  # the global batch's mean loss (the ranks' mean) is the one process's, step by step
        got = torch.tensor([r["losses"] for r in res], dtype=torch.float64).mean(0)
        torch.testing.assert_close(got, torch.tensor(_reference_losses(), dtype=torch.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_two_gpus_submit_nccl_collectives_in_the_same_order() -> None:
    """The same on two GPUs: the exchange group and DDP's both NCCL communicators of one device per rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    logs = [r["log"] for r in launch(_ordered_training, 2, (0.01, "cuda"))]
    assert logs[1] == logs[0], f"rank 1's collectives came in another order than rank 0's:\n{logs[1]}\n{logs[0]}"
    for epoch in logs[0].split("|")[1:]:
        assert epoch.replace("x", "") == _canonical(STEPS, PREFETCH), epoch
