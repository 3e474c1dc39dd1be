"""B5's node process (`benchmarks/multi_node.py --worker`): one process of a run trains (joining the torchrun
job, if any), then measures the all_to_all bandwidth between the ranks at the epoch's message size."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
from typing import Any

import torch

from benchmarks._common import seconds_per_call


def alltoall_bandwidth(nbytes: int, iters: int = 20) -> dict[str, Any]:
    """GB/s that each rank receives in an all_to_all where it receives ``nbytes`` in all, an equal part from every
    other rank (none from itself)."""
    import torch.distributed as dist  # noqa: PLC0415

    from datapath.features import new_exchange_group  # noqa: PLC0415

    group = new_exchange_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    per = max(1, int(nbytes) // max(world - 1, 1))
    splits = [0 if j == rank else per for j in range(world)]
    send = torch.randint(0, 255, (per * (world - 1),), dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)

    def once() -> None:
        dist.all_to_all_single(recv, send, splits, splits, group=group)

    for _ in range(3):
        once()
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = seconds_per_call(once, iters, cuda)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, send.numel() / seconds / 1e9)
    dist.destroy_process_group(group)
    return {"message_bytes": per * (world - 1), "GBps_per_rank": every, "GBps": min(every)}


def _epoch_store_stats(history: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """Tier counters of rank ``rank`` summed over the training epochs (None without a store)."""
    total: dict[str, dict[str, float]] = {}
    for h in history:
        st = h["ranks"][rank].get("feature_store")
        if st is None:
            return None
        for tier, vals in st.items():
            acc = total.setdefault(tier, {})
            for k, v in vals.items():
                if k != "hit_rate":
                    acc[k] = acc.get(k, 0) + v
    rows = sum(t["rows"] for t in total.values())
    for t in total.values():
        t["hit_rate"] = t["rows"] / rows if rows else 0.0
    return total


def worker(args: argparse.Namespace) -> None:
    """One process of a run: train (joins the torchrun job, if any), then measure the all_to_all bandwidth."""
    import torch.distributed as dist  # noqa: PLC0415

    from datapath.apps import train, TrainConfig  # noqa: PLC0415
    from datapath.apps.launch import shutdown_distributed  # noqa: PLC0415
    from datapath.apps.machine import device_label  # noqa: PLC0415

    cfg = TrainConfig(**json.loads(args.cfg))
    if os.environ.get("RANK") is not None:  # a hung run: the orchestrator asks for every thread's stack (SIGUSR1)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        (args.out.parent / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    try:
        res = train(cfg)
        world = res["world_size"]
        stores = [_epoch_store_stats(res["history"], r) for r in range(world)]
        out = {k: res[k] for k in ("world_size", "device", "backend", "setup_s", "test_acc", "features_on",
                                   "graph_on")}
        out["device_name"] = device_label() if cfg.device == "cuda" else "cpu"
        out["epochs"] = [h["aggregate"] for h in res["history"]]
        out["stores"] = stores
        if world > 1 and stores[0] is not None:
            ex = [s["remote"]["exchanges"] for s in stores]
            per_batch = statistics.mean(s["remote"]["received_bytes"] / max(e, 1) for s, e in zip(stores, ex))
            out["alltoall"] = [alltoall_bandwidth(int(per_batch * f)) for f in (1.0, 0.25, 4.0)]
        if res["rank"] == 0:
            args.out.write_text(json.dumps(out, default=str))
    finally:
        if dist.is_initialized():
            shutdown_distributed()
