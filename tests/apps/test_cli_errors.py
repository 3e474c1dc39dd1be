"""CLI user errors: one line naming the argument or file, a nonzero exit, no traceback (unless --verbose)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from datapath.cli import main
from datapath.graph import prepare_dataset


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = int(exc.code)
    cap = capsys.readouterr()
    return code, cap.err + cap.out


@pytest.mark.parametrize("argv, needle", [
    (["train-gnn", "--dataset", "/no/such/dir"], "--dataset '/no/such/dir' is neither a dataset directory"),
    (["train-gnn", "--fanouts", "garbage"], "argument --fanouts: expected comma-separated integers"),
    (["train-gnn", "--fanouts", "10,0"], "argument --fanouts: each fanout must be a positive integer"),
    (["train-gnn", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["train-gnn", "--epochs", "two"], "argument --epochs: expected a int"),
    (["train-gnn", "--device", "cpu", "--features-on", "cuda"], "features_on/graph_on 'cuda' need device 'cuda'"),
    (["train-gnn", "--json", "/no/such/dir/out.json"], "cannot write the JSON output /no/such/dir/out.json"),
    (["train-gnn", "--dropout", "1.5"], "dropout must lie in [0, 1)"),
    (["prepare-dataset", "nosuch", "/tmp/x"], "unknown dataset preset 'nosuch'"),
])
def test_user_errors_print_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, text = _run(capsys, *argv)
    assert code == 2, text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith(f"datapath {argv[0]}: error: ") and needle in lines[0], text
    assert "Traceback" not in text


def test_prepare_into_a_dataset_needs_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "D"
    prepare_dataset("tiny", d, device="cpu", progress=False)
    code, text = _run(capsys, "prepare-dataset", "tiny", str(d), "--device", "cpu")
    assert code == 2 and text.count("\n") == 1 and "exists and is not empty" in text and "--overwrite" in text


def test_a_damaged_dataset_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "D"
    prepare_dataset("tiny", d, device="cpu", progress=False)
    os.truncate(d / "indices.npy", 1000)
    code, text = _run(capsys, "train-gnn", "--dataset", str(d), "--device", "cpu", "--no-progress")
    assert code != 0 and "Traceback" not in text
    assert text.strip().splitlines()[-1].startswith("datapath train-gnn: error: ")
    assert str(d / "indices.npy") in text


@pytest.mark.slow
def test_verbose_shows_the_traceback() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    quiet = subprocess.run([sys.executable, "-m", "datapath.cli", "train-gnn", "--dataset", "/no/such/dir"],
                           capture_output=True, text=True, env=env, timeout=120)
    loud = subprocess.run([sys.executable, "-m", "datapath.cli", "--verbose", "train-gnn", "--dataset",
                           "/no/such/dir"], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == loud.returncode == 2
    assert quiet.stderr.strip().count("\n") == 0 and "Traceback" not in quiet.stderr
    assert "Traceback" in loud.stderr and "neither a dataset directory" in loud.stderr
