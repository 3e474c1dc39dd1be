"""The order of a rank's collectives: a sharded store's exchanges (loader thread) and DDP's all-reduce (training
thread) are submitted in the same order on every rank, whatever the threads' timing (`CollectiveOrder`);
each exchange in two turns (its counts, then the rest), its counts read between them, outside the consumer's wait."""
from __future__ import annotations

import random
import re
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch, train_epoch
from datapath.apps.train_gnn import global_mean_loss, wrap_ddp
from datapath.features import sharded_store
from datapath.features.exchange import ShardedTier
from datapath.graph import ShardLayout, SyntheticSpec, generate
from datapath.loaders import CollectiveOrder, DistributedNeighborLoader, NeighborLoader
from datapath.memory import to_placement
from datapath.nn.models import build_model

STEPS, BATCH, PREFETCH = 9, 24, 2
SPEC = SyntheticSpec("s", 1200, 8000, 8, 4, seed=5)


def _canonical(total: int, ahead: int) -> str:
    """X: an exchange, A: a step's all-reduce: X(0..A), then A(k) X(k + A + 1), then the last steps."""
    return "X" * (ahead + 1) + "AX" * (total - ahead - 1) + "A" * (ahead + 1)


def _two_turns(total: int, ahead: int, brackets: bool = False) -> str:
    """Each exchange in two turns: turn t holds R(t - 1) (the rest of batch t - 1's exchange) then C(t) (batch t's
    counts); the request for batch k releases the turns up to k + A + 1; A: a step's all-reduce.  With ``brackets``
    each turn is written ``[...]``."""
    out, done = [], -1
    for k in range(total):
        while done < min(k + ahead + 1, total):
            done += 1
            body = ("R" if done > 0 else "") + ("C" if done < total else "")
            out.append(f"[{body}]" if brackets else body)
        out.append("A")
    return "".join(out)


def test_the_two_turn_schedule() -> None:
    assert _two_turns(4, 1) == "C" "RC" "RC" "A" "RC" "A" "R" "A" "A"
    assert _two_turns(2, 2) == "C" "RC" "R" "A" "A"


def _run_turns(total: int, ahead: int, phases: int, delays: list[tuple[float, float]]) -> str:
    """An exchange thread (X, or C then R in two turns) and a consumer (A) with the given delays; the log."""
    order = CollectiveOrder(total, ahead, threading.Event(), phases=phases)
    log: list[str] = []

    def exchange() -> None:
        try:
            for t in range(order.turns):
                time.sleep(delays[min(t, total - 1)][0])
                assert order.exchange_turn(t)
                if phases == 1:
                    log.append("X")
                else:
                    log.append(("R" if t > 0 else "") + ("C" if t < total else ""))
                order.exchanged(t)
        finally:
            order.end()

    t = threading.Thread(target=exchange)
    t.start()
    for k in range(total):
        order.consumer_turn(k)
        time.sleep(delays[k][1])
        log.append("A")
    t.join(10)
    return "".join(log)


@pytest.mark.parametrize("phases", [1, 2])
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_two_threads_take_turns_in_the_canonical_order(ahead: int, phases: int) -> None:
    """An exchange thread and a consumer with random delays: the order of their turns is fixed by the batch numbers."""
    total = 12
    for trial in range(5):
        rng = random.Random(trial * 10 + ahead)
        delays = [(rng.random() * 0.004, rng.random() * 0.004) for _ in range(total)]
        want = _canonical(total, ahead) if phases == 1 else _two_turns(total, ahead)
        assert _run_turns(total, ahead, phases, delays) == want, trial


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_consumer_does_not_wait_for_the_counts_read_between_two_turns(ahead: int) -> None:
    """Two turns: the request for batch k waits for turn k + A + 1 (batch k + A + 1's counts submitted), not for the
    read of those counts, which the exchange thread does after the turn; with one turn per exchange it would."""
    total = 6
    order = CollectiveOrder(total, ahead, threading.Event(), phases=2)
    unread = threading.Event()  # the read of the counts submitted in the last released turn may finish
    read: list[int] = []

    def exchange() -> None:
        try:
            for t in range(order.turns):
                if not order.exchange_turn(t):
                    return
                order.exchanged(t)
                if t == ahead + 2:  # batch A + 2's counts, submitted in the turn released by request 1
                    unread.wait(10)  # its read (a host synchronisation) blocks until the consumer got past request 1
                read.append(t)
        finally:
            order.end()

    t = threading.Thread(target=exchange)
    t.start()
    order.consumer_turn(0)
    t0 = time.perf_counter()
    order.consumer_turn(1)  # turn A + 2 submitted: returns though the read after it has not
    assert time.perf_counter() - t0 < 5 and read == list(range(ahead + 2)), read
    unread.set()
    for k in range(2, total):
        order.consumer_turn(k)
    t.join(10)
    assert read == list(range(order.turns)) and not t.is_alive()


@pytest.mark.parametrize("phases", [1, 2])
def test_a_stop_or_an_end_releases_every_wait(phases: int) -> None:
    stop = threading.Event()
    order = CollectiveOrder(5, 1, stop, phases=phases)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(order.exchange_turn(4)))
    t.start()
    time.sleep(0.2)
    assert not done  # turn 4 is not released before the consumer asks for batch 4 - A - (phases - 1)
    stop.set()
    t.join(2)
    assert done == [False]  # stopped: the exchange thread submits nothing
    t0 = time.perf_counter()
    order.consumer_turn(0)  # stopped: the consumer does not wait either
    assert time.perf_counter() - t0 < 1
    order = CollectiveOrder(5, 2, threading.Event(), phases=phases)
    t0 = time.perf_counter()
    threading.Timer(0.2, order.end).start()
    order.consumer_turn(0)  # nothing was exchanged; the exchange thread ends (its error reaches the queue)
    assert 0.15 < time.perf_counter() - t0 < 5
    with pytest.raises(ValueError, match="ahead must be >= 0"):
        CollectiveOrder(3, -1, threading.Event())
    with pytest.raises(ValueError, match="phases must be 1 or 2"):
        CollectiveOrder(3, 1, threading.Event(), phases=3)


def _ordered_training(jitter_s: float, device: str = "cpu") -> dict:
    """This rank trains through `train_epoch` with DDP over a sharded store, logging every collective it submits.

    The loader's exchange thread and the training thread sleep at random (per rank) between their collectives.
    ``device="cuda"``: one GPU per rank, NCCL for both groups.  The log: ``X`` an exchange's counts all_gather,
    ``x`` an all_to_all, ``A`` a step's all-reduce, ``[`` / ``]`` the exchange thread's turns (`CollectiveOrder`),
    ``s`` a read of an exchange's counts (its host synchronisation), ``|`` an epoch.  The read of batch j's counts
    (j > A) waits until the consumer's request for batch j - A - 1 has returned: it must return with those counts
    unread (``late`` lists the reads that waited for it in vain).
    """
    ctx, ds, store = _rank_store(device)
    dev = ctx.device
    graph, labels = (ds.graph, ds.labels) if dev.type == "cpu" else (ds.graph.to("unified"),
                                                                    to_placement(ds.labels, "cuda"))
    log: list[str] = []
    import datapath.features.exchange_steps as exchange  # noqa: PLC0415 - the spies wrap the real collectives
    real_gather, real_all_to_all = exchange._all_gather, dist.all_to_all_single  # noqa: SLF001

    def counts(*a, **k):  # the first collective of every exchange
        log.append("X")
        return real_gather(*a, **k)

    def all_to_all(*a, **k):
        log.append("x")
        return real_all_to_all(*a, **k)

    ahead = max(1, PREFETCH)  # the loader's CollectiveOrder's A
    cond = threading.Condition()
    state: dict = {"epoch": 0, "reads": 0, "returned": set(), "late": []}
    real_read = exchange._host_counts  # noqa: SLF001
    real_turn, real_xturn, real_xed = (CollectiveOrder.consumer_turn, CollectiveOrder.exchange_turn,
                                       CollectiveOrder.exchanged)

    def consumer_turn(self, k):
        real_turn(self, k)
        with cond:
            state["returned"].add((state["epoch"], k))
            cond.notify_all()

    def exchange_turn(self, t):
        ok = real_xturn(self, t)
        if ok:
            log.append("[")
        return ok

    def exchanged(self, t):
        log.append("]")
        real_xed(self, t)

    def read_counts(c):  # the exchange thread, between its turns: not before the consumer got batch j - A - 1
        with cond:
            j, epoch = state["reads"], state["epoch"]
            state["reads"] += 1
            key = (epoch, j - ahead - 1)
            if j > ahead and not state["late"] and not cond.wait_for(lambda: key in state["returned"], timeout=3):
                state["late"].append((epoch, j))
        log.append("s")
        return real_read(c)

    exchange._all_gather = counts  # noqa: SLF001
    dist.all_to_all_single = all_to_all
    exchange._host_counts = read_counts  # noqa: SLF001
    CollectiveOrder.consumer_turn, CollectiveOrder.exchange_turn = consumer_turn, exchange_turn
    CollectiveOrder.exchanged = exchanged
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
    for epoch in range(2):
        with cond:
            state["epoch"], state["reads"] = epoch, 0
        log.append("|")
        losses += train_epoch(model, loader, opt, loss_fn=loss_fn).losses
    exchange._all_gather, dist.all_to_all_single = real_gather, real_all_to_all  # noqa: SLF001
    exchange._host_counts = real_read  # noqa: SLF001
    CollectiveOrder.consumer_turn, CollectiveOrder.exchange_turn = real_turn, real_xturn
    CollectiveOrder.exchanged = real_xed
    return {"log": "".join(log), "losses": losses, "late": state["late"]}


def _check_two_turns(res: list[dict]) -> None:
    """Every rank's log the same (but for where its counts reads fall beside the steps), each epoch in the two-turn
    schedule: the counts read once between two turns, never inside one, and never inside the consumer's wait."""
    ahead = max(1, PREFETCH)
    submitted = [r["log"].replace("s", "") for r in res]
    for r, lg in enumerate(submitted):  # identical on every rank
        assert lg == submitted[0], f"rank {r}'s collectives came in another order than rank 0's:\n{lg}\n{submitted[0]}"
    for r in res:
        assert not r["late"], f"a read of an exchange's counts waited for the consumer's request to return: {r['late']}"
        for epoch in r["log"].split("|")[1:]:
            calls = re.sub("x+", "R", epoch).replace("X", "C")  # one exchange's all_to_alls (ids, row pieces): R
            assert calls.replace("s", "") == _two_turns(STEPS, ahead, brackets=True), epoch
            # its counts read between the turn that submitted them and the next, once: never inside a turn
            assert calls.replace("A", "") == "".join(
                f"[{'R' if t else ''}{'C' if t < STEPS else ''}]" + ("s" if t < STEPS else "") for t in range(STEPS + 1)
            ), epoch


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
    _check_two_turns(res)
    if world == WORLD:  # the global batch's mean loss (the ranks' mean) is the one process's, step by step
        got = torch.tensor([r["losses"] for r in res], dtype=torch.float64).mean(0)
        torch.testing.assert_close(got, torch.tensor(_reference_losses(), dtype=torch.float64), rtol=1e-4, atol=1e-5)


def _break_and_fail() -> dict:
    """Two epochs over a sharded store (gloo): one left after 3 batches on every rank, one whole; then one in which
    rank 1's worker fails to gather its batch 4 (its exchange thread tells the others in that batch's counts)."""
    ctx, ds, store = _rank_store("cpu")
    loader = _cpu_loader(ctx, ds, store)
    out: dict = {"left": [], "whole": []}
    for i, batch in enumerate(loader):
        out["left"].append(torch.equal(batch.x, ds.features[batch.input_nodes]))
        dist.all_reduce(torch.ones(1))
        if i == 2:
            break
    for batch in loader:  # the exchanges still pair up after the epoch left with counts submitted ahead
        out["whole"].append(torch.equal(batch.x, ds.features[batch.input_nodes]))
        dist.all_reduce(torch.ones(1))
    real, calls = store.start_gather, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if ctx.rank == 1 and calls[0] == 5:
            raise RuntimeError("rank 1 could not gather batch 4")
        return real(*args, **kwargs)

    store.start_gather = failing
    out.update(_take_until_error(loader, ds))
    return out


def _rank_store(device: str) -> tuple[Any, Any, Any]:
    """This rank's process group (one thread), the dataset (every rank generates the same) and this rank's even
    share of its features as a sharded store (rows exchanged in 1 KiB pieces)."""
    ctx = init_distributed(device)
    torch.set_num_threads(1)
    ds = generate(SPEC, device="cpu", progress=False)
    layout = ShardLayout.even(ds.graph.num_nodes, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    return ctx, ds, sharded_store(ds.features[lo:hi], layout, device=ctx.device, piece_bytes=1024)


def _cpu_loader(ctx: Any, ds: Any, store: Any) -> Any:
    """The rank's shuffled loader over ``store`` on the CPU (fanouts 5, 3; ``STEPS`` batches an epoch)."""
    return DistributedNeighborLoader(ds.graph, ds.train_idx, [5, 3], BATCH, shuffle=True, rank=ctx.rank,
                                     world_size=ctx.world_size, features=store, labels=ds.labels, device="cpu",
                                     prefetch=PREFETCH, max_steps=STEPS)


def _take_until_error(loader: Any, ds: Any) -> dict:
    """Train on ``loader``'s batches (rows checked, an all-reduce a step) until it ends or raises: the batches
    taken, the error (type name, message) and the seconds it took."""
    out: dict = {"taken": 0, "error": None}
    t0 = time.perf_counter()
    try:
        for batch in loader:
            assert torch.equal(batch.x, ds.features[batch.input_nodes])
            dist.all_reduce(torch.ones(1))
            out["taken"] += 1
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = (type(exc).__name__, str(exc))
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.mark.slow
def test_a_left_epoch_and_a_failed_batch_end_every_rank_in_order() -> None:
    res = launch(_break_and_fail, WORLD)
    for r, out in enumerate(res):
        assert out["left"] == [True] * 3 and out["whole"] == [True] * STEPS, out
        # every batch before the failed one, then the error in its place, on every rank, without waiting for a timeout
        assert out["taken"] == 4 and out["seconds"] < 30, out
        name, msg = out["error"]
        if r == 1:
            assert name == "RuntimeError" and "could not gather batch 4" in msg
        else:
            assert name == "ShardExchangeError" and "rank 1 could not fetch" in msg, msg


def _fail_in_preparation() -> dict:
    """Rank 1's exchange thread fails to prepare batch 4's exchange (between two turns, where no collective may be
    submitted): the failure takes the batch's place in its turn, and every rank stops there."""
    ctx, ds, store = _rank_store("cpu")
    real, calls = ShardedTier.prepare_fetch_slots, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if ctx.rank == 1 and calls[0] == 5:
            raise RuntimeError("rank 1 could not prepare batch 4")
        return real(self, *args, **kwargs)

    ShardedTier.prepare_fetch_slots = failing
    loader = _cpu_loader(ctx, ds, store)
    try:
        return _take_until_error(loader, ds)
    finally:
        ShardedTier.prepare_fetch_slots = real


@pytest.mark.slow
def test_a_failed_preparation_takes_its_batch_place_on_every_rank() -> None:
    for r, out in enumerate(launch(_fail_in_preparation, WORLD)):
        assert out["taken"] == 4 and out["seconds"] < 30, out  # batches 0..3, then the error, without a timeout
        name, msg = out["error"]
        if r == 1:
            assert name == "RuntimeError" and "could not prepare batch 4" in msg
        else:
            assert name == "ShardExchangeError" and "rank 1 could not fetch" in msg, msg


@pytest.mark.gpu
def test_gpu_two_gpus_submit_nccl_collectives_in_the_same_order() -> None:
    """The same on two GPUs: the exchange group and DDP's both NCCL communicators of one device per rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_two_turns(launch(_ordered_training, 2, (0.01, "cuda")))


# what the preparation of an exchange runs between the turns, never in one (a turn runs the collectives, the owner's
# gather of the rows asked of it, with its index conversions, and the scatter behind each piece received)
_PREPARATION = ("aten.sort.", "aten.searchsorted.", "aten.repeat_interleave.", "aten.arange.", "aten.cat.",
                "aten.empty.")


def _ops_in_and_between_turns() -> dict:
    """The ops the loader's exchange thread runs from its first turn on (aten and c10d, through a dispatch mode of that
    thread only), each with whether it ran inside a turn of its `CollectiveOrder` (2 gloo ranks, rows in pieces)."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    ctx, ds, store = _rank_store("cpu")
    ops: list[tuple[bool, str]] = []
    here = threading.local()  # the exchange thread's mode and whether it is inside a turn

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append((here.turn, str(func)))
            return func(*args, **(kwargs or {}))

    real_xturn, real_xed, real_end = CollectiveOrder.exchange_turn, CollectiveOrder.exchanged, CollectiveOrder.end

    def exchange_turn(self, t):
        ok = real_xturn(self, t)
        if getattr(here, "mode", None) is None:  # the exchange thread's first turn: record its ops from here on
            here.mode = Record()
            here.mode.__enter__()
        here.turn = ok
        return ok

    def exchanged(self, t):
        here.turn = False
        real_xed(self, t)

    def end(self):  # the exchange thread's last call (also made by the consumer's thread, which records nothing)
        if getattr(here, "mode", None) is not None:
            here.mode.__exit__(None, None, None)
            here.mode = None
        real_end(self)

    CollectiveOrder.exchange_turn, CollectiveOrder.exchanged, CollectiveOrder.end = exchange_turn, exchanged, end
    try:
        loader = DistributedNeighborLoader(ds.graph, ds.train_idx, [5, 3], BATCH, shuffle=True, rank=ctx.rank,
                                           world_size=ctx.world_size, features=store, labels=ds.labels, device="cpu",
                                           prefetch=PREFETCH, max_steps=STEPS)
        equal = [torch.equal(batch.x, ds.features[batch.input_nodes]) for batch in loader]
    finally:
        CollectiveOrder.exchange_turn, CollectiveOrder.exchanged, CollectiveOrder.end = real_xturn, real_xed, real_end
    return {"ops": ops, "equal": equal}


@pytest.mark.slow
def test_a_turn_runs_only_the_collectives_and_what_follows_them() -> None:
    """The sort by owner, the row numbers, the buffers and split sizes of an exchange are made between the turns (while
    the consumer trains), not in a turn (while it waits): in a turn only the collectives, the owner's gather and the
    scatter; no collective between the turns."""
    for r, out in enumerate(launch(_ops_in_and_between_turns, WORLD)):
        assert out["equal"] == [True] * STEPS, r
        inside = [op for turn, op in out["ops"] if turn]
        between = [op for turn, op in out["ops"] if not turn]
        collectives = [op for op in inside if op.startswith("c10d.")]
        # every exchange's counts all_gather and its ids and rows all_to_alls (several pieces), in the turns
        assert sum("allgather" in op for op in collectives) == STEPS, collectives
        assert sum("alltoall" in op for op in collectives) > 2 * STEPS, collectives
        assert not [op for op in between if op.startswith("c10d.")], between
        assert sum("index_copy" in op for op in inside) > STEPS  # each piece scattered behind its all_to_all
        moved = sorted({op for op in inside if op.startswith(_PREPARATION)})
        assert not moved, f"rank {r}: a turn ran preparation that needs no collective: {moved}"
        for prep in ("aten.sort.", "aten.searchsorted.", "aten.repeat_interleave.", "aten.arange.", "aten.empty."):
            assert any(op.startswith(prep) for op in between), (r, prep)  # made here, between the turns
