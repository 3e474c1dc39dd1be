"""The multi-process launcher under signals and failures: ranks stopped, nothing left behind, right exit codes.

Each test runs the real ``datapath train-gnn --gpus 2`` (CPU ranks, gloo) in its own session
with private table and temporary directories, sends a real signal to the launcher process
alone (not its process group), and checks what remains.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC), "DATAPATH_SHM_DIR": str(shm), "TMPDIR": str(tmp),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "datapath.cli", "train-gnn", "--gpus", "2", "--device", "cpu", "--no-progress",
         "--eval-nodes", "0", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, shm, tmp


def _wait_for_training(proc: subprocess.Popen, shm: Path, timeout: float = 90.0) -> list[psutil.Process]:
    """The rank processes, once both ranks train (the shared tables exist and rank 0 said so)."""
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("training sage"):
            ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                     if "spawn_main" in " ".join(c.cmdline())]
            assert len(ranks) == 2, "".join(lines)
            assert any(shm.iterdir()), "".join(lines)
            time.sleep(1.0)  # well into the epochs
            return ranks
        if proc.poll() is not None:
            break
    raise AssertionError("the job did not start training:\n" + "".join(lines) + (proc.stdout.read() or ""))


def _leftovers(tmp: Path) -> list[str]:
    """What the job left in its temporary directory (PyTorch's compile cache is meant to persist)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _assert_clean(ranks: list[psutil.Process], shm: Path, tmp: Path, out: str) -> None:
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"rank processes outlived the launcher: {alive}\n{out}"
    assert list(shm.iterdir()) == [], f"shared tables left behind\n{out}"
    assert _leftovers(tmp) == [], f"temporary files left behind: {_leftovers(tmp)}\n{out}"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_a_signal_to_the_launcher_alone_stops_the_ranks_and_cleans_up(tmp_path: Path, sig: int, code: int) -> None:
    proc, shm, tmp = _start(tmp_path, "--epochs", "1000")
    try:
        ranks = _wait_for_training(proc, shm)
        t0 = time.monotonic()
        os.kill(proc.pid, sig)  # the launcher only: its ranks must hear of it from the launcher
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, out
        assert proc.returncode == code, out
        assert "Traceback" not in out and "Exception ignored" not in out, out
        _assert_clean(ranks, shm, tmp, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_failed_job_leaves_no_error_files(tmp_path: Path) -> None:
    """A job whose ranks fail (a dataset directory they cannot read) ends with one line and nothing left."""
    bad = tmp_path / "not-a-dataset"
    bad.mkdir()
    (bad / "meta.json").write_text("{}")
    proc, shm, tmp = _start(tmp_path, "--dataset", str(bad), "--epochs", "1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out  # one line, no rank's traceback on the terminal
    assert lines[0].startswith("datapath train-gnn: error: rank 0 of 2 failed: ") and "DatasetError" in lines[0], out
    assert list(shm.iterdir()) == [] and _leftovers(tmp) == []


_SWALLOWED = """
import os, signal, sys, weakref
from datapath.apps import exit_if_stopped, init_distributed, stop_requested
init_distributed("cpu")          # one process: installs the rank's stop handler, no process group

class Table:
    pass

def on_free(_):                  # the handler runs inside this callback, where Python ignores a raise
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100000):
        pass

t = Table()
ref = weakref.ref(t, on_free)
del t
print("survived the callback", stop_requested() == signal.SIGTERM, flush=True)
exit_if_stopped()
print("kept running", flush=True)
"""


@pytest.mark.slow
def test_a_stop_signal_swallowed_by_a_callback_still_stops_the_loop(tmp_path: Path) -> None:
    """A rank's SIGTERM landing in a weakref callback (its SystemExit ignored there) still ends the rank at the
    training loop's next check, with 143 and without Python's 'Exception ignored' report."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, "-c", _SWALLOWED], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 128 + signal.SIGTERM, (res.stdout, res.stderr)
    assert "survived the callback True" in res.stdout, (res.stdout, res.stderr)
    assert "kept running" not in res.stdout
    assert "Exception ignored" not in res.stderr and "Traceback" not in res.stderr, res.stderr
