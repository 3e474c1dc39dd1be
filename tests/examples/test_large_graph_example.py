"""examples/large_graph.py runs end to end at a tiny size on the CPU (features read through the store's tiers)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_large_graph_example_trains_from_disk(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(ROOT / "examples" / "large_graph.py"), "--preset", "tiny", "--device", "cpu",
           "--directory", str(tmp_path / "tiny"), "--fanouts", "10,5", "--batch-size", "512", "--epochs", "2",
           "--gpu-cache", "10%", "--host-memory", "20%"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "wrote tiny" in text and "disk" in text and "epoch 1:" in text
    acc = float(text.rsplit("validation accuracy", 1)[1].split()[0])
    assert acc > 0.4  # chance is 1/8
