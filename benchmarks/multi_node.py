"""Features sharded over simulated nodes: 1 GPU with the whole table vs N nodes, each with 1/N of the features.

Per dataset (products; a papers-shaped graph of ``--papers-gb``), with N = ``--nodes`` (2 by default; any
number, one GPU per node, as many GPUs as nodes):

1. ``datapath prepare-dataset NAME DIR --shards N`` (once, under ``--data-dir``); node ``r`` gets a
   directory of its own holding every file but the other nodes' shards (hard links);
2. **1 GPU**: this script's worker runs `datapath.apps.train` (what ``train-gnn`` runs) on the whole
   table (read from both shards, pinned, gathered zero copy), batch ``--batch-size``;
3. **N nodes**: N ``torchrun --nnodes N --node-rank r --nproc-per-node 1 --master-addr 127.0.0.1``
   launches, ``CUDA_VISIBLE_DEVICES=r`` (one GPU each), each given only its node's directory, run the
   worker with ``shard_features`` (``train-gnn --shard-features``): no shared memory segment, the other
   nodes' rows come over NCCL.  ``strong``: ``--batch-size / N`` seeds per rank (the 1-GPU batches exactly,
   the same steps and learning curve: the headline); ``weak``: ``--batch-size`` seeds per rank (1/N of the
   steps).  After training, the worker measures the NCCL all_to_all bandwidth between the GPUs on a group
   of the same backend, at the message size of the epoch's mean remote rows per batch (and 1/4 and 4x).

``--model RESULT.json`` prints, from a result's 1-GPU, weak and strong records, the model of
``docs/multi_node.md`` (bytes per batch against link bandwidth) checked against the N-node
measurement and extended to more GPUs and InfiniBand links (no GPU needed).

Model as B2: GraphSAGE, fanouts 15,10,5, hidden 256, dropout 0.5, Adam 3e-3; ``--epochs`` epochs,
epoch time = median of the epochs after the first (slowest rank).  Records (``records`` in
``results/<name>.json``): ``{dataset, nodes, gpus_per_node, mode, epoch_s, test_acc, fetch_over_alltoall,
remote_bytes_per_batch, hit_rate_local, remote_cache_hit_rate, device}`` plus the batch, tier shares,
each exchange stage's time per batch, the remote fetch's GB/s (received bytes / GPU time of the
tier's fetches: counts, ids, rows) and the NCCL all_to_all GB/s at that message size.

    PYTHONPATH=src:. python benchmarks/multi_node.py                          # 2 GPUs (scripts/gpu_check.sh --suite b5)
    PYTHONPATH=src:. python benchmarks/multi_node.py --nodes 4 --modes strong # 4 GPUs, 4 simulated nodes
    PYTHONPATH=src:. python benchmarks/multi_node.py --device cpu --quick     # end to end on a CPU (gloo), tiny

The CPU run checks that the pipeline works; its numbers are not the benchmark's.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, write_result
from benchmarks.multi_node_model import model

log = logging.getLogger("datapath.bench.multi_node")
ROOT = Path(__file__).resolve().parents[1]
SCALING_BAR, ACC_BAR, BW_BAR = 0.90, 0.005, 0.70
"""Bars: N-node epoch <= 1 / (SCALING_BAR x N) of the 1-GPU epoch (0.55x at N = 2), test accuracy within
ACC_BAR, the remote fetch at >= BW_BAR of NCCL all_to_all's bandwidth at the batch's message size."""
CUDA_ENV = ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_LAUNCH_MODE", "TORCH_NCCL_BLOCKING_WAIT")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 epochs of 12 steps (a smoke test)")
    p.add_argument("--datasets", default="products,papers")
    p.add_argument("--papers-gb", type=float, default=4.0, help="host memory of the papers-shaped graph [4]")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes, one GPU each [2]")
    p.add_argument("--batch-size", type=int, default=1024, help="the 1-GPU batch (the global batch) [1024]")
    p.add_argument("--prefetch", type=int, default=2, help="batches each loader stage prepares ahead [2]")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-batches", type=int, default=None, help="steps per epoch at most [all]")
    p.add_argument("--eval-nodes", type=int, default=10_000)
    p.add_argument("--modes", default="strong,weak")
    p.add_argument("--caches", default="none",
                   help="GPU caches of the N-node strong runs, comma-separated: none, or SCOPE:SIZE (any:25%%: the "
                        "hottest rows of any shard, remote ones included; own:50%%: of the node's own shard, served "
                        "from its GPU) [none]; the weak run uses the first")
    p.add_argument("--model", type=Path, default=None, metavar="JSON",
                   help="print the bytes-vs-link model of docs/multi_node.md from this result's records and exit")
    p.add_argument("--fixed-share", type=float, default=None,
                   help="--model: the share of a step that does not shrink with the batch [from the strong run]")
    p.add_argument("--fixed-ms", type=float, default=None,
                   help="--model: the exchange's fixed cost per batch in ms [from the strong run]")
    p.add_argument("--graph-on", default=None, help="graph placement of every run [unified on GPUs]")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "datapath-multi-node",
                   help="where the datasets are prepared (kept for the next run) [$TMPDIR/datapath-multi-node]")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--repeat", type=int, default=1,
                   help="make each N-node run this many times (how often a run hangs: failed_runs) [1]")
    p.add_argument("--name", default=None, help="result name [multi_node; multi_node_quick with --quick]")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="only merge the records of these result files (e.g. the products and papers calls of "
                        "scripts/gpu_check.sh --suite b5 / b5-papers) into results/<name>.json and its plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.nodes < 2:
        p.error(f"--nodes must be at least 2, got {args.nodes}")
    if args.quick:
        args.datasets, args.epochs, args.batch_size, args.hidden = "tiny", 2, 256, 64
        args.fanouts, args.eval_nodes, args.max_batches = "10,5", 2000, args.max_batches or 12
    args.name = args.name or ("multi_node_quick" if args.quick else "multi_node")
    args.graph_on = args.graph_on or ("unified" if args.device == "cuda" else "cpu")
    return args


# -- in each process of a run --------------------------------------------------------------
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
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            once()
        b.record()
        b.synchronize()
        seconds = a.elapsed_time(b) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        seconds = (time.perf_counter() - t0) / iters
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


# -- the orchestrator ----------------------------------------------------------------------
def _env(visible: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PYTHONUNBUFFERED": "1"}
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def prepare(args: argparse.Namespace, name: str) -> tuple[Path, list[Path]]:
    """The dataset with N feature shards (made once) and the N nodes' directories (hard links)."""
    n = args.nodes
    d = args.data_dir / f"{name}-{n}shards"
    if not (d / "meta.json").is_file():
        cmd = [sys.executable, "-m", "datapath.cli", "prepare-dataset", name, str(d), "--shards", str(n), "--device",
               args.device, "--overwrite"]
        if name == "papers":
            cmd += ["--memory-gb", str(args.papers_gb)]
        t0 = time.perf_counter()
        subprocess.run(cmd, env=_env("0" if args.device == "cuda" else None), check=True, timeout=args.timeout)
        print(f"prepared {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    nodes = []
    for r in range(n):
        nd = args.data_dir / f"{name}-node{r}"
        shutil.rmtree(nd, ignore_errors=True)
        nd.mkdir(parents=True)
        for p in d.iterdir():
            if "shard" not in p.name or p.name == f"features.shard-{r}-of-{n}.npy":
                os.link(p, nd / p.name)
        nodes.append(nd)
    return d, nodes


def _cache(text: str) -> tuple[str | None, str]:
    """``"none"`` -> (None, "any"); ``"own:50%"`` -> ("50%", "own")."""
    if text == "none":
        return None, "any"
    scope, _, size = text.partition(":")
    if scope not in ("any", "own") or not size:
        raise SystemExit(f"--caches: {text!r} is neither none nor SCOPE:SIZE (any:25%, own:50%)")
    return size, scope


def _cfg(args: argparse.Namespace, dataset: Path, batch: int, sharded: bool, cache: str = "none") -> str:
    size, scope = _cache(cache)
    return json.dumps({"dataset": str(dataset), "model": "sage", "epochs": args.epochs, "batch_size": batch,
                       "fanouts": [int(f) for f in args.fanouts.split(",")], "hidden": args.hidden,
                       "dropout": args.dropout, "lr": args.lr, "device": args.device, "graph_on": args.graph_on,
                       "max_batches": args.max_batches, "eval_nodes": args.eval_nodes, "seed": 0,
                       "shard_features": sharded, "gpu_cache": size if sharded else None, "cache_scope": scope,
                       "features_on": None if sharded else ("unified" if args.device == "cuda" else "cpu"),
                       "prefetch": args.prefetch})


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_one_gpu(args: argparse.Namespace, dataset: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / "one.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cfg",
           _cfg(args, dataset, args.batch_size, False), "--out", str(out)]
    subprocess.run(cmd, env=_env("0" if args.device == "cuda" else None), check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def run_nodes(args: argparse.Namespace, nodes: list[Path], batch: int, tmp: Path, cache: str) -> dict[str, Any]:
    """One run of ``len(nodes)`` torchrun launches (one rank and GPU each); rank 0's result."""
    out, port, n = tmp / "nodes.json", _free_port(), len(nodes)
    for f in tmp.glob("pid*"):
        f.unlink()
    procs = []
    for r, nd in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--node-rank", str(r),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(Path(__file__).resolve()), "--worker", "--cfg", _cfg(args, nd, batch, True, cache), "--out",
               str(out)]
        env = _env(str(r) if args.device == "cuda" else None)
        env.setdefault("NCCL_DEBUG", "INFO")  # the log says how NCCL links the processes (nccl_transport)
        if args.device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // n))
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp / f"node{r}.log", "w"), stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:  # a hung run: every worker's thread stacks into its log, then end it all
        workers = [int(f.read_text()) for f in tmp.glob("pid*")]
        for pid in workers:
            _signal(pid, signal.SIGUSR1)
        time.sleep(3.0)
        for pid in workers:
            _signal(pid, signal.SIGKILL)
        for p in procs:
            p.kill()
        codes = [f"killed after {args.timeout:.0f} s ({p.wait()})" for p in procs]
    if codes != [0] * n:
        def tail(r: int) -> str:  # the log without NCCL's INFO lines (the transport lines fill it)
            lines = (tmp / f"node{r}.log").read_text().splitlines()
            return "\n".join(ln for ln in lines if " NCCL INFO " not in ln)[-20000:]
        tails = "".join(f"\n-- node {r}:\n" + tail(r) for r in range(n))
        raise RuntimeError(f"the {n}-node run failed (exit codes {codes}){tails}")
    run = json.loads(out.read_text())
    # NCCL_DEBUG=INFO: the log says how NCCL links the GPUs ("via P2P/IPC", "via SHM/...", "via NET/...")
    log_text = (tmp / "node0.log").read_text()
    run["nccl_transport"] = sorted(set(re.findall(r"Channel \d+(?:/\d+)? : \d+\[\S+\] -> \d+\[\S+\] (?:\[\w+\] )?"
                                              r"via (\S+)", log_text)))
    return run


def _epoch_s(run: dict[str, Any]) -> tuple[float, list[float]]:
    times = [e["epoch_s"] for e in run["epochs"]]
    return (statistics.median(times[1:]) if len(times) > 1 else times[0]), times


def record(dataset: str, run: dict[str, Any], mode: str, batch: int, cache: str = "none") -> dict[str, Any]:
    nodes = run["world_size"]
    epoch_s, times = _epoch_s(run)
    rec: dict[str, Any] = {"dataset": dataset, "nodes": nodes, "gpus_per_node": 1, "mode": mode,
                           "batch_per_rank": batch, "epoch_s": epoch_s, "epochs_s": times,
                           "test_acc": run["test_acc"], "remote_bytes_per_batch": 0.0, "hit_rate_local": 1.0,
                           "device": run["device_name"], "backend": run["backend"] if nodes > 1 else None,
                           "gpu_cache": cache if nodes > 1 else "none", "nccl_transport": run.get("nccl_transport")}
    last = run["epochs"][-1]  # where the last epoch's time went (slowest rank per column): the loader's stages
    rec["breakdown_s"] = {k: last.get(k) for k in ("sample_s", "gather_s", "train_s", "wait_s")}
    rec["steps"] = last.get("batches")
    stores = [s for s in run["stores"] if s is not None]
    if nodes > 1 and stores:
        rem = [s["remote"] for s in stores]
        rec["rows_per_batch"] = statistics.mean(sum(s[t]["rows"] for t in s) / max(s["remote"]["exchanges"], 1)
                                                for s in stores)  # input rows of a rank's batch, every tier
        got = sum(r["received_rows"] for r in rem)
        rec["row_bytes"] = sum(r["received_bytes"] for r in rem) / got if got else None
        hits = sum(r.get("remote_cache_rows", 0) for r in rem)
        rec["remote_cache_hit_rate"] = hits / max(hits + sum(r["received_rows"] for r in rem), 1)
        # each exchange stage per batch (ms; GPU time on CUDA), the slowest rank: counts (sort by owner +
        # the counts all_gather, the one host sync), ids (their all_to_all), rows (owner's gather + rows
        # all_to_all + scatter), wall (host time of the whole call) = submit (host time of its collectives and
        # what follows them, in the loader's turns; submit_cpu: the thread's CPU time in them) + prepare (what
        # precedes them, between the turns) + counts_wait (the host's wait for the counts, between the turns)
        rec["stage_ms_per_batch"] = {
            k: max(r.get(f"{k}_seconds", 0.0) / max(r["exchanges"], 1) * 1e3 for r in rem)
            for k in ("counts", "ids", "exchange", "wall", "submit", "submit_cpu", "prepare", "counts_wait")}
        rec["remote_bytes_per_batch"] = statistics.mean(r["received_bytes"] / max(r["exchanges"], 1) for r in rem)
        rec["id_bytes_per_batch"] = statistics.mean(r["id_bytes"] / max(r["exchanges"], 1) for r in rem)
        rec["hit_rate_local"] = statistics.mean(1.0 - r["hit_rate"] for r in rem)
        rec["hit_rates"] = {t: statistics.mean(s[t]["hit_rate"] for s in stores) for t in stores[0]}
        rec["remote_fetch_GBps"] = min(r["received_bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0 for r in rem)
        rec["rows_exchange_GBps"] = min(r["received_bytes"] / r["exchange_seconds"] / 1e9
                                        if r["exchange_seconds"] else 0.0 for r in rem)
        bw = run.get("alltoall") or []
        if bw:
            rec["alltoall_message_bytes"] = bw[0]["message_bytes"]
            rec["nccl_alltoall_GBps"] = bw[0]["GBps"]
            rec["alltoall_curve"] = {b["message_bytes"]: b["GBps"] for b in bw}
            rec["fetch_over_alltoall"] = rec["remote_fetch_GBps"] / bw[0]["GBps"] if bw[0]["GBps"] else None
            rec["rows_over_alltoall"] = rec["rows_exchange_GBps"] / bw[0]["GBps"] if bw[0]["GBps"] else None
    return rec


def ratio_bar(nodes: int) -> float:
    """The N-node epoch over the 1-GPU epoch that the bar allows (scaling efficiency `SCALING_BAR`)."""
    return 1.0 / (SCALING_BAR * nodes)


def bars(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in records}):
        one = next((r for r in records if r["dataset"] == ds and r["nodes"] == 1), None)
        for r in records:
            if r["dataset"] != ds or r["nodes"] == 1 or one is None:
                continue
            key = f"{ds}/{r['mode']}" + ("" if r["gpu_cache"] == "none" else f"/{r['gpu_cache']}") + \
                (f"#{r['repeat']}" if "repeat" in r else "")
            b = {"epoch_ratio": r["epoch_s"] / one["epoch_s"], "acc_diff": r["test_acc"] - one["test_acc"],
                 "fetch_over_alltoall": r.get("fetch_over_alltoall")}
            b["ratio_bar"] = ratio_bar(r["nodes"])
            b["time_met"] = b["epoch_ratio"] <= b["ratio_bar"]
            b["acc_met"] = abs(b["acc_diff"]) <= ACC_BAR
            b["bw_met"] = None if b["fetch_over_alltoall"] is None else b["fetch_over_alltoall"] >= BW_BAR
            out[key] = b
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    datasets = sorted({r["dataset"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, ds in enumerate(datasets):
        rs = [r for r in records if r["dataset"] == ds]
        for j, r in enumerate(rs):
            label = "1 GPU" if r["nodes"] == 1 else f"{r['nodes']} nodes {r['mode']} cache {r['gpu_cache']}"
            ax.bar(6 * i + j, r["epoch_s"], color=["#8c8c8c", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"][j % 5],
                   label=label if i == 0 else None)
            ax.text(6 * i + j, r["epoch_s"], f"{r['test_acc']:.3f}", ha="center", va="bottom", fontsize=7)
        one = next((r for r in rs if r["nodes"] == 1), None)
        nodes = max(r["nodes"] for r in rs)
        if one and nodes > 1:
            bar = ratio_bar(nodes)
            ax.plot([6 * i + 0.6, 6 * i + len(rs) - 0.6], [bar * one["epoch_s"]] * 2, "k--", lw=1,
                    label=f"bar {bar:.2f} x 1 GPU" if i == 0 else None)
    ax.set_xticks([6 * i + 1 for i in range(len(datasets))], datasets)
    ax.set_ylabel("epoch (s); label: test accuracy")
    ax.legend(fontsize=7)
    ax = axes[1]
    rs = [r for r in records if r.get("nccl_alltoall_GBps")]
    for i, r in enumerate(rs):
        ax.bar([3 * i, 3 * i + 1], [r["remote_fetch_GBps"], r["nccl_alltoall_GBps"]], color=["#d62728", "#8c8c8c"])
    ax.set_xticks([3 * i + 0.5 for i in range(len(rs))],
                  [f"{r['dataset']} {r['mode']}\n{r['gpu_cache']}\n{r['alltoall_message_bytes'] / 2**20:.1f} MiB"
                   for r in rs], fontsize=7)
    ax.set_ylabel("GB/s per rank")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#d62728", "#8c8c8c")],
              labels=["remote fetch", "all_to_all at that size"], fontsize=7)
    nodes = max(r["nodes"] for r in records)
    fig.suptitle(f"features sharded over {nodes} nodes vs 1 GPU ({records[0]['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _payload(args: argparse.Namespace, records: list[dict[str, Any]], total_s: float) -> dict[str, Any]:
    return {
        "description": f"GraphSAGE with the features sharded over {args.nodes} simulated nodes (torchrun launches, one "
                       "GPU each, no shared segment) vs 1 GPU with the whole table",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bars": {"time": f"N-node epoch <= 1 / ({SCALING_BAR} N) x the 1-GPU epoch (strong: same global batch; "
                         f"0.55x at N = 2)", "accuracy": f"within {ACC_BAR}",
                 "bandwidth": f"remote fetch >= {BW_BAR} x NCCL all_to_all at the batch's message size"},
        "notes": {"epoch_s": "median of the epochs after the first; slowest rank",
                  "remote_bytes_per_batch": "feature bytes a rank receives from the other nodes per training batch "
                                            "(ids not counted: id_bytes_per_batch)",
                  "remote_cache_hit_rate": "rows of other shards found in the rank's own GPU cache / all rows of "
                                           "other shards its batches needed",
                  "stage_ms_per_batch": "each exchange stage per batch, slowest rank (GPU time): counts = sort by "
                                        "owner + counts all_gather (the one host sync), ids = ids all_to_all, "
                                        "exchange = owner's gather + rows all_to_all + scatter; wall = host time "
                                        "= submit (its collectives and what follows them, in the loader's turns; "
                                        "submit_cpu: the thread's CPU time in them) + prepare (the sort, buffers "
                                        "and split sizes, between the turns) + counts_wait (host wait for the "
                                        "counts, between the turns)",
                  "remote_fetch_GBps": "received bytes / GPU time of the remote tier's fetches (sort, counts "
                                       "all_gather, ids all_to_all, the owner's gather, rows all_to_all), slowest rank",
                  "rows_exchange_GBps": "received bytes / GPU time of the owner's gather and the rows all_to_all",
                  "nccl_alltoall_GBps": "all_to_all_single of the mean remote bytes per batch, each rank to the "
                                        "other, same backend, after training; slowest rank",
                  "rows_over_alltoall": "rows_exchange_GBps / nccl_alltoall_GBps (the rows stage alone)",
                  "nccl_transport": "how NCCL linked the processes (its NCCL_DEBUG=INFO log)"},
        "records": records, "summary": bars(records), "total_s": total_s}


def merge(args: argparse.Namespace) -> None:
    """results/<name>.json and its plot from the records of several result files."""
    docs = [json.loads(p.read_text()) for p in args.merge]
    records = [r for d in docs for r in d["records"]]
    payload = _payload(args, records, sum(d.get("total_s", 0.0) for d in docs))
    payload.update(merged_from=[{"command": d.get("command"), "date": d.get("date"), "machine": d.get("machine")}
                                for d in docs])
    path = write_result(args.name, payload)
    plot(records, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    print_table([{"run": k, **v} for k, v in payload["summary"].items()])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse()
    if args.worker:
        worker(args)
        return
    if args.merge:
        merge(args)
        return
    if args.model:
        records = json.loads(args.model.read_text())["records"]
        for ds in sorted({r["dataset"] for r in records}):
            print(f"{ds}: strong scaling, the 1-GPU batch {args.batch_size} cut over the GPUs")
            print_table(model(records, ds, fixed_share=args.fixed_share, fixed_ms=args.fixed_ms))
        return
    if args.device == "cuda" and torch.cuda.device_count() < args.nodes:
        sys.exit(f"the {args.nodes}-node run needs {args.nodes} GPUs (one per simulated node), this machine has "
                 f"{torch.cuda.device_count()}; use --device cpu --quick for a smoke test")
    records: list[dict[str, Any]] = []
    failed: list[str] = []
    t_start = time.perf_counter()
    for name in args.datasets.split(","):
        d, nodes = prepare(args, name)
        with tempfile.TemporaryDirectory(prefix="multi-node-") as tmp:
            t0 = time.perf_counter()
            records.append(record(name, run_one_gpu(args, d, Path(tmp)), "-", args.batch_size))
            print(f"{name}: 1 process done in {time.perf_counter() - t0:.0f} s", flush=True)
            caches = args.caches.split(",")
            for mode in args.modes.split(","):
                for cache, rep in [(c, k) for c in (caches if mode == "strong" else caches[:1])
                                   for k in range(args.repeat)]:
                    batch = args.batch_size if mode == "weak" else args.batch_size // args.nodes
                    what = f"{name} {mode} {cache}" + (f" #{rep}" if args.repeat > 1 else "")
                    t0 = time.perf_counter()
                    try:
                        run = run_nodes(args, nodes, batch, Path(tmp), cache)
                    except RuntimeError as exc:  # the other runs still measure; the failure is in the log
                        failed.append(what)
                        print(f"{what}: {args.nodes} nodes FAILED: {exc}", flush=True)
                        continue
                    records.append(record(name, run, mode, batch, cache))
                    if args.repeat > 1:
                        records[-1]["repeat"] = rep
                    print(f"{what}: {args.nodes} nodes done in {time.perf_counter() - t0:.0f} s", flush=True)
                    write_result(args.name, {"partial": True, "records": records})
    payload = _payload(args, records, time.perf_counter() - t_start)
    payload["failed_runs"] = failed
    payload["env"] = {k: os.environ.get(k) for k in CUDA_ENV}  # what the runs inherited that can change a hang
    summary = payload["summary"]
    path = write_result(args.name, payload)
    plot(records, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    print_table([{k: r.get(k) for k in ("dataset", "nodes", "mode", "gpu_cache", "batch_per_rank", "epoch_s", "test_acc",
                                        "remote_bytes_per_batch", "hit_rate_local", "remote_fetch_GBps",
                                        "nccl_alltoall_GBps", "device")} for r in records])
    print_table([{"run": k, **v} for k, v in summary.items()])
    if failed:
        sys.exit(f"runs that failed (see above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
