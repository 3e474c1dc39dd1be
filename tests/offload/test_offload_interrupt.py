"""Ctrl-C inside an offloaded training loop lands in the loop: nothing interruptible runs in a finalizer.

Each test runs a real training loop under ``offload(model, target="ssd", path=...)`` (CPU tensors offloaded too) in a child process
with Python's default SIGINT handler and checks that the `KeyboardInterrupt` reaches the loop (exit 130)
within a second of the signal, with no "Exception ignored" on stderr and no activation file left.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

LOOP = """
import os, signal, sys, time, torch
from datapath.offload import offload
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
x = torch.randn(4096, 512)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
steps = {steps}
try:
    with offload(model, target="ssd", path={path!r}, offload_cpu_tensors=True):
        for step in range(steps):
            if step == 1:
                {arm}
                print("ready", flush=True)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
except KeyboardInterrupt:
    print("interrupted", time.time(), flush=True)
    sys.exit(130)
print("finished", flush=True)
"""

# Sends SIGINT to itself the moment an offloaded entry is released: where the release runs inside a
# finalizer (``__del__``) Python reports "Exception ignored" and drops the interrupt.
ARM_AT_RELEASE = """
def at_release(frame, event, arg):
                    if event == "call" and frame.f_code.co_name == "drop_handle":
                        sys.setprofile(None)
                        os.kill(os.getpid(), signal.SIGINT)
                sys.setprofile(at_release)"""


def _child(tmp_path: Path, steps: int, arm: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(LOOP).format(steps=steps, path=str(tmp_path / "acts"), arm=arm.strip())
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _leftover_files(tmp_path: Path) -> list[Path]:
    root = tmp_path / "acts"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.mark.slow
def test_sigint_while_an_entry_is_released_reaches_the_loop(tmp_path: Path) -> None:
    p = _child(tmp_path, steps=8, arm=ARM_AT_RELEASE)
    out, err = p.communicate(timeout=180)
    assert "Exception ignored" not in err, err[-2000:]
    assert p.returncode == 130, (p.returncode, out, err[-2000:])
    assert "interrupted" in out and "finished" not in out
    assert not _leftover_files(tmp_path)


@pytest.mark.slow
def test_sigint_at_random_moments_stops_the_loop_within_a_second(tmp_path: Path) -> None:
    rng = random.Random(36)
    for attempt in range(4):
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        p = _child(run_dir, steps=10_000, arm="pass")
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.5))
        sent = time.time()
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"attempt {attempt}: SIGINT lost, the loop went on for 30 s\n{err[-2000:]}")
        assert "Exception ignored" not in err, err[-2000:]
        assert p.returncode == 130, (attempt, p.returncode, err[-2000:])
        landed = float(out.split("interrupted", 1)[1].split()[0]) - sent
        assert landed < 1.0, f"attempt {attempt}: the interrupt reached the loop {landed:.2f} s after SIGINT"
        assert not _leftover_files(run_dir)
