"""train-gnn on NaN features stops at the first batch with one line naming the epoch and batch (exit 1);
``--allow-nonfinite`` trains on."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from datapath.cli import main
from datapath.graph import Dataset, Graph


def _dataset(directory: Path, poison: str) -> Path:
    g = torch.Generator().manual_seed(4)
    n = 300
    graph = Graph.from_edge_index(torch.randint(0, n, (2, 2000), generator=g), n)
    feats = torch.randn(n, 8, generator=g)
    if poison == "all":
        feats[:] = float("nan")
    ids = torch.randperm(n, generator=g)
    Dataset("poisoned", graph, feats, torch.randint(0, 3, (n,), generator=g), ids[:200].sort().values,
            ids[200:250].sort().values, ids[250:].sort().values, 3).save(directory)
    return directory


ARGS = ["--device", "cpu", "--epochs", "2", "--batch-size", "64", "--max-batches", "2", "--eval-nodes", "20",
        "--hidden", "16", "--no-progress"]


def test_nan_features_stop_training_naming_epoch_and_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _dataset(tmp_path / "ds", "all")
    rc = main(["train-gnn", "--dataset", str(d), *ARGS])
    captured = capsys.readouterr()
    assert rc == 1, captured
    line = captured.err.strip()
    assert "\n" not in line and "Traceback" not in line, captured.err
    assert line.startswith("datapath train-gnn: error: epoch 1, batch 1: the loss is nan (not finite)")
    assert "input feature values are NaN/inf" in line and "--allow-nonfinite" in line
    assert "epoch 0:" not in captured.out  # no epoch was reported as trained


@pytest.mark.slow
def test_allow_nonfinite_trains_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _dataset(tmp_path / "ds", "all")
    assert main(["train-gnn", "--dataset", str(d), *ARGS, "--allow-nonfinite"]) == 0
    assert "loss nan" in capsys.readouterr().out

