"""benchmarks/gnn_pieces.py on a small graph on the CPU: every piece timed at every batch size, its JSON and plot
written (the script's GPU run is the issue-39 diagnostic; here it must run end to end and say what it measured)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gnn_pieces_times_every_piece(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gnn_pieces.py"), "--quick", "--device", "cpu",
                           "--batch-sizes", "64,128", "--batches", "3", "--repeats", "2", "--name", "pieces"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                               "BENCH_RESULTS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "pieces.json").read_text())
    recs = doc["records"]
    assert {(r["batch_size"], r["piece"]) for r in recs} == {
        (b, p) for b in (64, 128) for p in ("loader", "loader_serial", "step", "loop", "train_epoch")}
    for r in recs:
        assert r["rounds"] == 2 and r["batches"] == 3 and r["device"] == "cpu"
        assert 0 < r["ms_min"] <= r["ms_per_batch"] <= r["ms_max"] and r["cpu_ms_per_batch"] > 0, r
    step = {r["batch_size"]: r["ms_per_batch"] for r in recs if r["piece"] == "step"}
    assert step[128] > step[64]  # on the CPU the step's aggregation work grows with the batch
    assert (tmp_path / "pieces.png").exists() or "matplotlib not installed" in proc.stdout
