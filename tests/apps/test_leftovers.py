"""Nothing outlives its job: a process sharing a dataset, or the ``--gpus`` launcher, killed outright (SIGKILL:
no atexit, no finally) still leaves no shared table in the shm directory and no ``datapath-launch-*`` folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

SHARE_AND_WAIT = """
import time, torch
from datapath.apps.shared_data import share_dataset
from datapath.graph import Dataset, Graph
g = torch.Generator().manual_seed(0)
n = 200
graph = Graph.from_edge_index(torch.randint(0, n, (2, 800), generator=g), n)
ids = torch.randperm(n, generator=g)
ds = Dataset("d", graph, torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g),
             ids[:100].sort().values, ids[100:150].sort().values, ids[150:].sort().values, 3)
desc, shared = share_dataset(ds, "h36kill")
print("ready", flush=True)
time.sleep(600)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "DATAPATH_SHM_DIR": str(shm), "TMPDIR": str(tmp_path)}


def _wait_for(cond: Callable[[], bool], seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_sigkill_of_the_process_sharing_a_dataset_removes_its_tables(tmp_path: Path) -> None:
    env = _env(tmp_path)
    shm = Path(env["DATAPATH_SHM_DIR"])
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SHARE_AND_WAIT)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.communicate()
        assert len(list(shm.glob("datapath-h36kill.*"))) >= 14  # 7 tables: data and description each
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        assert _wait_for(lambda: not list(shm.glob("datapath-h36kill.*")), 3.0), sorted(shm.iterdir())
    finally:
        if p.poll() is None:
            p.kill()


def _kill_group(p: subprocess.Popen) -> None:
    """End whatever the test started (its own process group), if anything is left."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
def test_sigkill_of_the_gpus_launcher_leaves_no_folder_no_table_and_no_rank(tmp_path: Path) -> None:
    env = _env(tmp_path)
    shm = Path(env["DATAPATH_SHM_DIR"])
    p = subprocess.Popen([sys.executable, "-m", "datapath.cli", "train-gnn", "--gpus", "2", "--device", "cpu",
                          "--dataset", "tiny", "--epochs", "1000", "--batch-size", "64", "--hidden", "16",
                          "--eval-nodes", "0", "--no-progress"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        ok = _wait_for(lambda: bool(list(tmp_path.glob("datapath-launch-*")) and list(shm.glob("datapath-*.bin")))
                       or p.poll() is not None, 240)
        assert ok and p.poll() is None, p.communicate()
        ranks = _children(p.pid)
        time.sleep(1.0)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        assert _wait_for(lambda: not list(tmp_path.glob("datapath-launch-*")), 3.0), list(tmp_path.iterdir())
        assert _wait_for(lambda: not any(Path(f"/proc/{r}").exists() and
                                         "zombie" not in Path(f"/proc/{r}/status").read_text().lower()
                                         for r in ranks), 15.0), "a rank outlived the launcher"
        assert _wait_for(lambda: not list(shm.glob("datapath-*")), 5.0), sorted(shm.iterdir())
    finally:
        _kill_group(p)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


@pytest.mark.slow
def test_sigkill_of_rank_0_under_torchrun_leaves_no_table(tmp_path: Path) -> None:
    env = {**_env(tmp_path), "OMP_NUM_THREADS": "1"}
    shm = Path(env["DATAPATH_SHM_DIR"])
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "datapath.cli", "train-gnn", "--device", "cpu", "--dataset", "tiny", "--epochs", "1000",
                          "--batch-size", "64", "--hidden", "16", "--eval-nodes", "0", "--no-progress"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        ok = _wait_for(lambda: bool(list(shm.glob("datapath-*.bin"))) or p.poll() is not None, 240)
        assert ok and p.poll() is None, p.communicate()
        time.sleep(1.0)
        rank0 = [q for q in _descendants(p.pid) if _rank_of(q) == 0]
        assert rank0, "rank 0 not found"
        os.kill(rank0[0], signal.SIGKILL)
        p.wait(timeout=120)  # torchrun's agent ends the job: the other rank is stopped
        assert p.returncode != 0
        assert _wait_for(lambda: not list(shm.glob("datapath-*")), 5.0), sorted(shm.iterdir())
    finally:
        _kill_group(p)
