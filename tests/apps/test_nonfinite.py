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


def _loader(device: str):
    from datapath.loaders import NeighborLoader

    g = torch.Generator().manual_seed(9)
    n = 2000
    graph = Graph.from_edge_index(torch.randint(0, n, (2, 20000), generator=g), n)
    feats, labels = torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)
    if device == "cuda":
        graph, feats, labels = graph.to("unified"), feats.pin_memory(), labels.pin_memory()
    return NeighborLoader(graph, torch.arange(n), [5, 3], 40, shuffle=True, features=feats, labels=labels,
                          device=device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bad", [0, 5, 17, 49])
def test_a_nan_loss_stops_the_epoch_naming_its_batch(device: str, bad: int) -> None:
    """The first batch whose loss is NaN is named (1-based) however late the host reads the device's flag: on a GPU
    it is read without waiting (a copy a few batches later, or at the epoch's end: batch 49 is the last)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from datapath.apps import train_epoch
    from datapath.apps.errors import NonFiniteLossError
    from datapath.nn.models import build_model

    loader = _loader(device)
    assert len(loader) == 50
    model = build_model("sage", 12, 16, 4, 2, dropout=0.0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(out, batch.y)
        seen.append(len(seen))
        return loss * float("nan") if len(seen) - 1 >= bad else loss

    with pytest.raises(NonFiniteLossError, match=rf"^epoch 3, batch {bad + 1}: the loss is nan \(not finite\)"):
        train_epoch(model, loader, opt, loss_fn=loss_fn, epoch=2)
    # the CPU stops at the bad batch; a GPU within a few batches of it (never before)
    assert len(seen) == bad + 1 if device == "cpu" else bad + 1 <= len(seen) <= min(50, bad + 1 + 3 * 8)
