"""benchmarks/split_rows.py on 1/20 of products on the CPU: every (batch size, split) measured, a rank's rows between
its seeds' share and the whole batch's (its sample is part of the batch's: draws are per node), JSON and plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "split_rows.py"), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                               "BENCH_RESULTS_DIR": str(tmp_path)})


@pytest.mark.slow
def test_split_rows_measures_every_split(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--quick", "--batch-sizes", "256,1024", "--batches", "2", "--ranks", "3", "--name", "rows")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = json.loads((tmp_path / "rows.json").read_text())["records"]
    assert {(r["batch_size"], r["split"]) for r in recs} == {
        (b, s) for b in (256, 1024) for s in ("random", "community", "planted")}
    for r in recs:
        assert r["ranks"] == 3 and r["batches"] == 2
        assert r["rows_batch"] / 3 <= r["rows_rank"] <= r["rows_batch"], r
        assert r["rank_share"] == pytest.approx(r["rows_rank"] / r["rows_batch"])
    batch = {r["batch_size"]: r["rows_batch"] for r in recs}
    assert batch[1024] > batch[256]
    assert (tmp_path / "rows.png").exists() or "matplotlib not installed" in proc.stdout


def test_split_rows_needs_two_ranks(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--ranks", "1")
    assert proc.returncode == 2 and "--ranks must be at least 2, got 1" in proc.stderr
