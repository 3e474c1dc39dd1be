"""examples/pyg_sage.py runs as a user would run it, and the PyG model learns."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pyg_sage_example_learns() -> None:
    pytest.importorskip("torch_geometric")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "pyg_sage.py"), "--epochs", "2", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"mean loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout
    acc = float(re.search(r"test accuracy ([0-9.]+)", proc.stdout).group(1))
    assert acc > 0.5, proc.stdout  # chance is 1/8
