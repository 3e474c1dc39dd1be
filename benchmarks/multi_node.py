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
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, write_result
from benchmarks._multi_node_args import parse, per_rank_batch
from benchmarks._multi_node_report import merge, plot, record, result_payload
from benchmarks._multi_node_worker import worker
from benchmarks.multi_node_model import model

log = logging.getLogger("datapath.bench.multi_node")
ROOT = Path(__file__).resolve().parents[1]
CUDA_ENV = ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_LAUNCH_MODE", "TORCH_NCCL_BLOCKING_WAIT")


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


def _worker_pids(tmp: Path) -> list[int]:
    """The node workers' pids (each writes ``tmp/pid<rank>`` when it starts)."""
    pids = []
    for f in tmp.glob("pid*"):
        try:
            pids.append(int(f.read_text()))
        except ValueError:  # being written
            pass
    return pids


def _end_nodes(procs: list[subprocess.Popen], tmp: Path, grace: float = 10.0) -> None:
    """End every node still running: its worker killed, its torchrun asked to stop (SIGTERM: it ends a worker that
    has not written its pid yet), then killed after ``grace`` seconds."""
    for pid in _worker_pids(tmp):
        _signal(pid, signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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
    """One run of ``len(nodes)`` torchrun launches (one rank and GPU each); rank 0's result.

    Each node's output goes to ``tmp/node<r>.log``; every way out (a finished run, a failed or hung one, an
    exception here, Ctrl-C included) closes the logs and leaves no node running."""
    out, port, n = tmp / "nodes.json", _free_port(), len(nodes)
    for f in tmp.glob("pid*"):
        f.unlink()
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as logs:
        try:
            for r, nd in enumerate(nodes):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--node-rank", str(r),
                       "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                       str(Path(__file__).resolve()), "--worker", "--cfg", _cfg(args, nd, batch, True, cache),
                       "--out", str(out)]
                env = _env(str(r) if args.device == "cuda" else None)
                env.setdefault("NCCL_DEBUG", "INFO")  # the log says how NCCL links the processes (nccl_transport)
                if args.device == "cpu":
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // n))
                log_file = logs.enter_context(open(tmp / f"node{r}.log", "w"))  # noqa: SIM115 - closed by the stack
                procs.append(subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT))
            codes = _wait_nodes(args, procs, tmp)
        finally:  # an exception here: no node outlives the orchestrator
            if any(p.poll() is None for p in procs):
                _end_nodes(procs, tmp)
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


def _wait_nodes(args: argparse.Namespace, procs: list[subprocess.Popen], tmp: Path) -> list[Any]:
    """The nodes' exit codes; a run past ``--timeout``: every worker's thread stacks into its log, then every node
    ended, and the code says so."""
    deadline = time.monotonic() + args.timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:  # a hung run: every worker's thread stacks into its log, then end it all
        for pid in _worker_pids(tmp):
            _signal(pid, signal.SIGUSR1)
        time.sleep(3.0)
        _end_nodes(procs, tmp)
        return [f"killed after {args.timeout:.0f} s ({p.returncode})" for p in procs]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse(description=__doc__)
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
                    batch = per_rank_batch(args, mode)  # strong: global batch = --batch-size exactly
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
    payload = result_payload(args, records, time.perf_counter() - t_start)
    payload["failed_runs"] = failed
    payload["env"] = {k: os.environ.get(k) for k in CUDA_ENV}  # what the runs inherited that can change a hang
    summary = payload["summary"]
    path = write_result(args.name, payload)
    plot(records, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    print_table([{k: r.get(k) for k in ("dataset", "nodes", "mode", "gpu_cache", "batch_per_rank", "global_batch",
                                        "epoch_s", "test_acc", "remote_bytes_per_batch", "hit_rate_local",
                                        "remote_fetch_GBps", "nccl_alltoall_GBps", "device")} for r in records])
    print_table([{"run": k, **v} for k, v in summary.items()])
    if failed:
        sys.exit(f"runs that failed (see above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
