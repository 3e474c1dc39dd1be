"""examples/hf_offload.py runs as a user would run it, at its tiny CPU configuration."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_offload.py"), "--tiny", *args],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_example_trains_with_offloading() -> None:
    out = _run("--steps", "4")
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 4 and all(0 < v < 20 for v in losses)
    offloaded = float(re.search(r"offloaded ([0-9.]+) MB", out).group(1))
    assert offloaded > 0


@pytest.mark.slow
def test_example_with_a_memory_budget(tmp_path: Path) -> None:
    out = _run("--steps", "6", "--memory-budget", "6MB", "--target", "ssd", "--path", str(tmp_path))
    assert re.search(r"plan for 0\.006 GB: offload [0-9.]+ MB per step", out), out
    assert list(tmp_path.iterdir()) == []  # the private directory went with the cache
