"""The sharded feature store on GPUs: rows of the whole table through the GPU cache, pinned shards and the exchange.

- one GPU: two ranks share it, the exchange goes over gloo (host memory), the store's batches are CUDA;
- two GPUs: NCCL, the loader's pipelined producer exchanging rows while DDP all-reduces gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from datapath.apps import init_distributed, launch
from datapath.apps.train_gnn import global_mean_loss, wrap_ddp
from datapath.features import new_exchange_group, presample_hotness, sharded_store
from datapath.graph import ShardLayout, SyntheticSpec, generate
from datapath.loaders import DistributedNeighborLoader
from datapath.memory import to_placement
from datapath.nn.models import build_model

pytestmark = pytest.mark.gpu

N, F_ = 5000, 33  # 132-byte rows: not a multiple of 128


def _table() -> torch.Tensor:
    return torch.randn(N, F_, generator=torch.Generator().manual_seed(1))


def _rows_match(store: torch.Tensor, rank: int, dev: torch.device) -> list[bool]:
    table = _table().to(dev)
    g = torch.Generator(device=dev).manual_seed(10 + rank)
    ok = []
    for k in (0, 1, 7, 4096, 0, 50_000):
        idx = torch.randint(-N, N, (k,), device=dev, generator=g)
        got = store[idx]
        ok.append(got.device == dev and torch.equal(got, table[idx]))
    return ok


def _one_gpu_gloo() -> dict:
    ctx = init_distributed("cpu")  # two ranks, one GPU: the exchange goes over gloo
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    store = sharded_store(_table()[lo:hi], layout, gpu_cache="15%", hotness=torch.rand(N), device=dev,
                          group=new_exchange_group(backend="gloo"))
    ok = _rows_match(store, ctx.rank, dev)
    try:
        store[torch.tensor([N] if ctx.rank == 0 else [0], device=dev)]
        err = None
    except Exception as exc:  # noqa: BLE001
        err = type(exc).__name__
    torch.ones(4, device=dev).sum().item()  # the CUDA context survives
    # the loader on the GPU: pipelined producer on side streams
    ds = generate(SyntheticSpec("s", N, 40_000, F_, 4, seed=3), device="cpu", progress=False)
    ds_store = sharded_store(ds.features[lo:hi], layout, device=dev, group=new_exchange_group(backend="gloo"))
    loader = DistributedNeighborLoader(ds.graph.to("unified"), ds.train_idx, [6, 3], 128, shuffle=True,
                                       rank=ctx.rank, world_size=2, features=ds_store,
                                       labels=to_placement(ds.labels, "cuda"), device=dev, prefetch=2, max_steps=5)
    for batch in loader:
        ok.append(torch.equal(batch.x.cpu(), ds.features[batch.input_nodes.cpu()]))
    return {"ok": ok, "err": err, "stats": ds_store.stats()}


def test_gpu_store_two_ranks_on_one_gpu_over_gloo() -> None:
    for r, out in enumerate(launch(_one_gpu_gloo, 2)):
        assert all(out["ok"]) and len(out["ok"]) == 11, out["ok"]
        assert out["err"] == ("IndexError" if r == 0 else "ShardExchangeError")
        st = out["stats"]
        assert st["remote"]["rows"] > 0 and st["host"]["rows"] > 0 and st["remote"]["seconds"] > 0


def _two_gpus_nccl() -> dict:
    ctx = init_distributed("cuda")
    dev = ctx.device
    layout = ShardLayout.even(N, ctx.world_size)
    lo, hi = layout.rows(ctx.rank)
    store = sharded_store(_table()[lo:hi], layout, gpu_cache="15%", hotness=torch.rand(N), device=dev)
    ok = _rows_match(store, ctx.rank, dev)
    # training: the producer thread exchanges rows over NCCL while DDP all-reduces over NCCL
    ds = generate(SyntheticSpec("s", N, 40_000, F_, 4, seed=3), device="cpu", progress=False)
    graph = ds.graph.to("unified")
    hot = presample_hotness(graph, ds.train_idx, [6, 3], batch_size=256, batches=8)
    feats = sharded_store(ds.features[lo:hi], layout, gpu_cache="10%", hotness=hot, device=dev)
    loader = DistributedNeighborLoader(graph, ds.train_idx, [6, 3], 128, shuffle=True, rank=ctx.rank,
                                       world_size=2, features=feats, labels=to_placement(ds.labels, "cuda"),
                                       device=dev, prefetch=2, max_steps=8)
    torch.manual_seed(0)
    net = build_model("sage", F_, 32, 4, 2).to(dev)
    model = wrap_ddp(net, ctx)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = global_mean_loss(2)
    losses = []
    for _ in range(2):
        for batch in loader:
            ok.append(torch.equal(batch.x.cpu(), ds.features[batch.input_nodes.cpu()]))
            loss = loss_fn(model(batch.blocks, batch.x), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    same = torch.tensor([sum(p.sum() for p in net.parameters())], device=dev)
    both = [torch.zeros_like(same) for _ in range(2)]
    dist.all_gather(both, same)
    return {"ok": ok, "stats": feats.stats(), "losses": losses, "params_equal": bool(torch.equal(*both))}


def test_gpu_two_gpus_nccl_exchange_beside_ddp() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for out in launch(_two_gpus_nccl, 2):
        assert all(out["ok"]) and len(out["ok"]) == 6 + 16, out["ok"]
        assert out["params_equal"] and out["losses"][-1] < out["losses"][0]
        st = out["stats"]
        assert st["gpu_cache"]["rows"] > 0 and st["remote"]["exchanges"] == 16
        assert st["remote"]["exchange_seconds"] > 0 and st["remote"]["received_bytes"] > 0
        # each stage timed on the GPU; the cache of the hottest rows of any shard served some of the other's rows
        assert st["remote"]["counts_seconds"] > 0 and st["remote"]["ids_seconds"] > 0
        assert st["remote"]["remote_cache_rows"] > 0
