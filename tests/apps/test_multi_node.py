"""Two nodes on one machine: two ``torchrun --nnodes 2 --node-rank 0/1`` launches of ``train-gnn --shard-features``.

Each node has a dataset directory of its own holding only its shard of the features; the job
trains like one process with the whole table and the global batch, and bad input (a missing or
malformed shard, a job size that does not match the shards, a rank killed mid-epoch) stops every
rank with an error naming the rank and the cause, leaving no shared segment or file behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from datapath.apps import TrainConfig, run_training
from datapath.graph import prepare_dataset, shard_file

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = ["--epochs", "2", "--max-batches", "8", "--batch-size", "128", "--hidden", "32", "--dropout", "0",
        "--fanouts", "8,4", "--eval-nodes", "600", "--seed", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_dataset("tiny", tmp_path_factory.mktemp("ds") / "tiny", shards=2, device="cpu", progress=False)


def _node_dir(prepared: Path, root: Path, node: int, shards: int = 2) -> Path:
    """What machine ``node`` holds: every file of the dataset but the other nodes' shards."""
    d = root / f"node{node}"
    d.mkdir(parents=True)
    for p in prepared.iterdir():
        if "shard" not in p.name or p.name == shard_file(node, shards):
            shutil.copy(p, d / p.name)
    return d


def _launch(dirs: list[Path], tmp: Path, extra: list[str], nnodes: int = 2, device: str = "cpu") -> list[subprocess.Popen]:
    """One torchrun per node (static rendezvous on 127.0.0.1), each in its own session; logs in tmp/node<r>.log.

    ``device="cuda"``: node ``r`` sees only GPU ``r`` (CUDA_VISIBLE_DEVICES), as on separate machines.
    """
    port = _free_port()
    (tmp / "tmp").mkdir(exist_ok=True)
    (tmp / "shm").mkdir(exist_ok=True)  # where a shared segment of the job would be made (there is none)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp / "tmp"),
           "DATAPATH_SHM_DIR": str(tmp / "shm")}
    procs = []
    for r, d in enumerate(dirs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(r),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
               "datapath.cli", "train-gnn", "--dataset", str(d), "--shard-features", "--device", device,
               "--no-progress", "--dist-timeout", "60", *extra]
        node_env = {**env, "CUDA_VISIBLE_DEVICES": str(r)} if device == "cuda" else env
        with open(tmp / f"node{r}.log", "w") as log:  # the node writes its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=node_env,
                                          start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"the nodes did not finish within {timeout} s")
    return codes


def _error_line(log: Path) -> str:
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("datapath train-gnn: error:")]
    return lines[0] if lines else log.read_text()[-3000:]


def _left_in_tmp(tmp: Path) -> list[str]:
    """What the job left in its TMPDIR, but for torch's own folders (torchrun's logs, the compiler's cache)."""
    return [p.name for p in (tmp / "tmp").iterdir() if not p.name.startswith(("torchelastic_", "torchinductor_"))]


def _shm(tmp: Path) -> list[str]:
    """Shared tables the job made (in its DATAPATH_SHM_DIR)."""
    return sorted(p.name for p in (tmp / "shm").iterdir())


@pytest.mark.slow
def test_two_nodes_train_like_one_process_with_the_whole_table(prepared: Path, tmp_path: Path) -> None:
    dirs = [_node_dir(prepared, tmp_path, r) for r in (0, 1)]
    assert not (dirs[0] / shard_file(1, 2)).exists() and not (dirs[1] / shard_file(0, 2)).exists()
    t0 = time.perf_counter()
    codes = _wait(_launch(dirs, tmp_path, [*ARGS, "--json", str(tmp_path / "run.json")]), 150)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    assert time.perf_counter() - t0 < 150
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["world_size"] == 2 and doc["backend"] == "gloo" and doc["features_on"] == "sharded"
    assert doc["feature_shard"] == {"rank": 0, "shards": 2, "rows": [0, 10_000]} and doc["shared_prefix"] is None
    # the reference: one process, the whole table (read from both shard files), the global batch
    ref = run_training(TrainConfig(dataset=str(prepared), epochs=2, max_batches=8, batch_size=256, hidden=32,
                                   dropout=0.0, fanouts=(8, 4), eval_nodes=600, seed=3, device="cpu"))[0]
    got = [e["aggregate"] for e in doc["epochs"]]
    want = [h["aggregate"] for h in ref["history"]]
    assert [g["batches"] for g in got] == [8, 8] and [g["seeds"] for g in got] == [w["seeds"] for w in want]
    np.testing.assert_allclose([g["loss"] for g in got], [w["loss"] for w in want], rtol=1e-4)
    assert abs(got[-1]["val_acc"] - want[-1]["val_acc"]) <= 0.01 and abs(doc["test_acc"] - ref["test_acc"]) <= 0.01
    assert doc["test_acc"] > 0.3  # chance is 0.125
    for rank in doc["epochs"][-1]["ranks"]:  # half the rows are the other node's, fetched from it
        st = rank["feature_store"]
        assert 0.35 < st["remote"]["hit_rate"] < 0.65 and st["host"]["hit_rate"] + st["remote"]["hit_rate"] == 1.0
        assert st["remote"]["received_bytes"] == st["remote"]["rows"] * 64 * 4 and st["remote"]["exchanges"] == 8
    assert _shm(tmp_path) == []
    assert _left_in_tmp(tmp_path) == []


def _break(kind: str, prepared: Path, tmp: Path) -> list[Path]:
    """The two nodes' directories, broken as ``kind`` says."""
    if kind == "world":
        three = tmp / "three"
        prepare_dataset("tiny", three, shards=3, device="cpu", progress=False)
        return [_node_dir(three, tmp, r, 3) for r in (0, 1)]
    dirs = [_node_dir(prepared, tmp, r) for r in (0, 1)]
    if kind == "missing":
        (dirs[1] / shard_file(1, 2)).unlink()
    elif kind == "shape":
        np.save(dirs[1] / shard_file(1, 2), np.ones((64, 10_000), np.float32))  # the same bytes, transposed
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("kind,node0,node1", [
    ("missing", r"rank 0 of 2 stops: rank 1 could not load its part of the dataset: DatasetError: .*node1/"
                r"features\.shard-1-of-2\.npy is missing",
     r"rank 1 of 2 failed: DatasetError: .*features\.shard-1-of-2\.npy is missing: shard 1 of 2"),
    ("shape", r"rank 0 of 2 stops: rank 1 could not load .*shape \(64, 10000\), but shard 1 of 2 must hold rows",
     r"rank 1 of 2 failed: DatasetError: .*shape \(64, 10000\), but shard 1 of 2 must hold rows 10000\.\.19999"),
    ("world", r"rank 0 of 2 failed: DatasetError: .*in 3 shards \(prepare-dataset --shards 3\) but the job has 2 ranks",
     r"rank 1 of 2 failed: DatasetError: .*in 3 shards .* but the job has 2 ranks"),
], ids=["missing-shard", "wrong-shape", "wrong-job-size"])
def test_bad_input_stops_every_rank_naming_the_rank(kind: str, node0: str, node1: str, prepared: Path,
                                                    tmp_path: Path) -> None:
    dirs = _break(kind, prepared, tmp_path)
    listing = [sorted(p.name for p in d.iterdir()) for d in dirs]
    t0 = time.perf_counter()
    codes = _wait(_launch(dirs, tmp_path, ARGS), 90)
    assert time.perf_counter() - t0 < 90 and codes == [1, 1]
    for r, pattern in enumerate((node0, node1)):
        line = _error_line(tmp_path / f"node{r}.log")
        assert re.search(pattern, line), line
    assert [sorted(p.name for p in d.iterdir()) for d in dirs] == listing and _shm(tmp_path) == []
    assert _left_in_tmp(tmp_path) == []


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_stops_the_other_node(prepared: Path, tmp_path: Path) -> None:
    dirs = [_node_dir(prepared, tmp_path, r) for r in (0, 1)]
    procs = _launch(dirs, tmp_path, ["--epochs", "100", "--batch-size", "128", "--hidden", "32", "--fanouts", "8,4",
                                     "--eval-nodes", "0"])
    deadline = time.monotonic() + 90
    while "epoch 0:" not in (tmp_path / "node0.log").read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
        time.sleep(0.1)
    workers = psutil.Process(procs[1].pid).children(recursive=True)
    assert len(workers) == 1
    t0 = time.perf_counter()
    workers[0].kill()  # SIGKILL: no clean-up runs on rank 1
    codes = _wait(procs, 60)
    assert time.perf_counter() - t0 < 60 and codes[0] == 1 and codes[1] != 0
    line = _error_line(tmp_path / "node0.log")
    # the error reaches rank 0 in the row exchange (producer thread) or in DDP's all-reduce: both say so
    assert re.match(r"datapath train-gnn: error: rank 0 of 2\b.*(Connection|connection).*another rank", line), line
    assert re.search(r"rank\s*: 1 \(local_rank: 0\)\s*\n\s*exitcode\s*: -9", (tmp_path / "node1.log").read_text())
    assert _shm(tmp_path) == []
    assert _left_in_tmp(tmp_path) == []



@pytest.mark.gpu
def test_gpu_two_nodes_one_gpu_each_nccl(prepared: Path, tmp_path: Path) -> None:
    """Two nodes, each seeing one GPU, NCCL between them: the losses of one GPU with the whole table."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    dirs = [_node_dir(prepared, tmp_path, r) for r in (0, 1)]
    args = [*ARGS, "--gpu-cache", "10%", "--json", str(tmp_path / "run.json")]
    codes = _wait(_launch(dirs, tmp_path, args, device="cuda"), 240)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["backend"] == "nccl" and doc["features_on"] == "sharded"
    ref = run_training(TrainConfig(dataset=str(prepared), epochs=2, max_batches=8, batch_size=256, hidden=32,
                                   dropout=0.0, fanouts=(8, 4), eval_nodes=600, seed=3, device="cuda"))[0]
    got = [e["aggregate"] for e in doc["epochs"]]
    want = [h["aggregate"] for h in ref["history"]]
    np.testing.assert_allclose([g["loss"] for g in got], [w["loss"] for w in want], rtol=1e-3)
    assert abs(doc["test_acc"] - ref["test_acc"]) <= 0.01
    for rank in doc["epochs"][-1]["ranks"]:
        st = rank["feature_store"]
        assert st["gpu_cache"]["rows"] > 0 and st["remote"]["rows"] > 0 and st["remote"]["exchanges"] == 8
        assert abs(sum(t["hit_rate"] for t in st.values()) - 1.0) < 1e-9
    assert _shm(tmp_path) == [] and _left_in_tmp(tmp_path) == []


def _log_fds(root: Path) -> list[str]:
    """The files under ``root`` that this process holds open (its /proc/self/fd links)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def _left_running(root: Path) -> list[str]:
    """Processes whose command line names ``root`` (a node or its worker that outlived the run)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["cmdline"] and any(str(root) in a for a in p.info["cmdline"]) and p.status() != "zombie":
                out.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])[:200]}")
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
def test_benchmark_run_nodes_closes_the_node_logs_on_every_way_out(prepared: Path, tmp_path: Path) -> None:
    """B5's ``run_nodes`` (``benchmarks/multi_node.py --device cpu --quick``'s N-node run): after a finished run, a
    failed one (a node's shard missing) and a hung one (killed at ``--timeout``), no node log stays open and no node
    or worker is left running."""
    import gc
    import warnings

    sys.path.insert(0, str(SRC.parent))
    from benchmarks._multi_node_args import parse
    from benchmarks.multi_node import run_nodes

    args = parse(["--device", "cpu", "--quick", "--data-dir", str(tmp_path / "data")])
    dirs = [_node_dir(prepared, tmp_path / "nodes", r) for r in (0, 1)]
    work = tmp_path / "work"
    work.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        run = run_nodes(args, dirs, 128, work, "none")
        assert run["world_size"] == 2 and run["backend"] == "gloo" and len(run["epochs"]) == 2
        assert _log_fds(work) == [] and _left_running(work) == []
        assert (work / "node0.log").stat().st_size > 0 and (work / "node1.log").stat().st_size > 0

        (dirs[1] / shard_file(1, 2)).rename(tmp_path / "away.npy")  # node 1 fails at once, then node 0
        with pytest.raises(RuntimeError, match=r"the 2-node run failed \(exit codes \[1, 1\]\)"):
            run_nodes(args, dirs, 128, work, "none")
        assert _log_fds(work) == [] and _left_running(work) == []
        (tmp_path / "away.npy").rename(dirs[1] / shard_file(1, 2))

        args.epochs, args.timeout = 1000, 8.0  # a run that does not end: killed at the timeout
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"exit codes \['killed after 8 s"):
            run_nodes(args, dirs, 128, work, "none")
        assert time.monotonic() - t0 < 60
        assert _log_fds(work) == [] and _left_running(work) == []
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and "node" in str(w.message)]
    assert unclosed == []


def test_benchmark_strong_batch_splits_over_the_nodes_exactly_or_is_refused(capsys: pytest.CaptureFixture) -> None:
    """B5 (``benchmarks/multi_node.py``) with 3 nodes: a 1-GPU batch that 3 does not divide is refused, naming the
    batches and node counts that work (not rounded down to a smaller global batch); one it divides is cut
    exactly, and the record states the global batch."""
    sys.path.insert(0, str(SRC.parent))
    from benchmarks._multi_node_args import parse
    from benchmarks._multi_node_report import record

    for argv, batch, nodes in ((["--quick"], 256, "2, 4, 8, 16, 32, 64"),
                               (["--batch-size", "1000"], 1000, "2, 4, 5, 8, 10, 20, 25, 40, 50")):
        with pytest.raises(SystemExit):
            parse(["--device", "cpu", "--nodes", "3", *argv])
        err = capsys.readouterr().err
        assert f"--batch-size {batch} does not split evenly over --nodes 3" in err, err
        assert (f"give --batch-size {batch // 3 * 3} or {batch // 3 * 3 + 3} (multiples of 3), --nodes {nodes} "
                f"(they divide {batch}), or --modes weak" in err), err
    from benchmarks._multi_node_args import per_rank_batch  # the plan's split, as main() makes it

    args = parse(["--device", "cpu", "--quick", "--nodes", "3", "--batch-size", "258"])
    strong, weak = per_rank_batch(args, "strong"), per_rank_batch(args, "weak")
    assert (strong, weak) == (86, 258)
    weak_only = parse(["--device", "cpu", "--nodes", "3", "--modes", "weak"])  # no split: every node the whole batch
    assert weak_only.batch_size == 1024 and per_rank_batch(weak_only, "weak") == 1024
    with pytest.raises(ValueError, match="does not split evenly over --nodes 3"):
        per_rank_batch(weak_only, "strong")
    run = {"world_size": 3, "epochs": [{"epoch_s": 2.0, "batches": 4}], "test_acc": 0.5, "device_name": "cpu",
           "backend": "gloo", "stores": []}
    rec = record("tiny", run, "strong", strong)
    assert rec["batch_per_rank"] == 86 and rec["global_batch"] == 258 == args.batch_size
    assert record("tiny", {**run, "world_size": 1}, "-", args.batch_size)["global_batch"] == 258
