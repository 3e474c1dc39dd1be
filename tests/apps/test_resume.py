"""``train-gnn --save DIR`` then ``--resume DIR``: the resumed run repeats the uninterrupted one exactly (CPU)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from datapath.apps import TrainConfig, run_training
from datapath.cli import main


def _cfg(**kw) -> TrainConfig:
    base = dict(dataset="tiny", device="cpu", epochs=4, max_batches=4, eval_nodes=300, seed=7, dropout=0.5,
                hidden=32, return_state=True)
    return TrainConfig(**{**base, **kw})


def _losses(result: dict) -> list[list[float]]:
    return [h["ranks"][0]["losses"] for h in result["history"]]


@pytest.mark.slow
def test_two_epochs_saved_and_resumed_equal_four_uninterrupted(tmp_path) -> None:
    whole = run_training(_cfg())[0]
    first = run_training(_cfg(epochs=2, save=str(tmp_path / "ck")))[0]
    assert (tmp_path / "ck" / "checkpoint.pt").is_file()
    shutil.copytree(tmp_path / "ck", tmp_path / "ck_epoch1")
    rest = run_training(_cfg(resume=str(tmp_path / "ck")))[0]
    assert _losses(first) == _losses(whole)[:2]
    assert _losses(rest) == _losses(whole)  # the history carries on: epochs 0-1 saved, 2-3 trained again
    assert [h["epoch"] for h in rest["history"]] == [0, 1, 2, 3]
    assert [h["aggregate"]["val_acc"] for h in rest["history"]] == [h["aggregate"]["val_acc"] for h in
                                                                   whole["history"]]
    assert rest["test_acc"] == whole["test_acc"]
    for k, v in whole["state"].items():
        assert torch.equal(rest["state"][k], v), k
    # without restoring the random states (dropout), the continuation differs: the test can fail
    ck = torch.load(tmp_path / "ck_epoch1" / "checkpoint.pt", weights_only=False)
    ck["rng"][0]["torch"] = torch.manual_seed(123).get_state()
    torch.save(ck, tmp_path / "ck_epoch1" / "checkpoint.pt")
    other = run_training(_cfg(resume=str(tmp_path / "ck_epoch1")))[0]
    assert _losses(other)[2] != _losses(whole)[2]


@pytest.mark.slow
def test_cli_save_resume_and_mismatch(tmp_path, capsys) -> None:
    args = ["train-gnn", "--device", "cpu", "--max-batches", "3", "--eval-nodes", "0", "--hidden", "16",
            "--no-progress"]
    ck = str(tmp_path / "ck")
    assert main([*args, "--epochs", "3", "--json", str(tmp_path / "whole.json")]) == 0
    assert main([*args, "--epochs", "1", "--save", ck]) == 0
    assert main([*args, "--epochs", "3", "--resume", ck, "--json", str(tmp_path / "rest.json")]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ck} at epoch 1 of 3" in out
    whole, rest = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "rest.json"))
    assert [e["aggregate"]["loss"] for e in rest["epochs"]] == [e["aggregate"]["loss"] for e in whole["epochs"]]
    assert torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=False)["epoch"] == 2  # saved on
    assert main([*args, "--epochs", "3", "--resume", ck, "--hidden", "32"]) == 2
    err = capsys.readouterr().err
    assert "is from another job (hidden: saved 16, now 32)" in err and err.count("\n") == 1
    assert main([*args, "--resume", str(tmp_path / "nothing")]) == 2
    assert "holds no checkpoint.pt" in capsys.readouterr().err


@pytest.mark.gpu
def test_resume_on_the_gpu(tmp_path) -> None:
    """On CUDA the CUDA random states are saved too; the continuation follows the uninterrupted run (to float
    tolerance: the GPU's aggregation kernels may add in another order)."""
    whole = run_training(_cfg(device="cuda", epochs=3))[0]
    run_training(_cfg(device="cuda", epochs=1, save=str(tmp_path / "ck")))
    ck = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=False)
    assert ck["rng"][0]["cuda"] is not None
    rest = run_training(_cfg(device="cuda", epochs=3, resume=str(tmp_path / "ck")))[0]
    a, b = _losses(whole), _losses(rest)
    assert len(a) == len(b) == 3
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)
    print("exact" if a == b else "within tolerance", a, b)


@pytest.mark.slow
def test_resume_data_parallel_on_cpus(tmp_path) -> None:
    """Two processes (gloo): each rank's random states are saved and restored; the losses follow the whole run."""
    whole = run_training(_cfg(epochs=2, max_batches=2, eval_nodes=0), nprocs=2)[0]
    run_training(_cfg(epochs=1, max_batches=2, eval_nodes=0, save=str(tmp_path / "ck")), nprocs=2)
    assert len(torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=False)["rng"]) == 2
    rest = run_training(_cfg(epochs=2, max_batches=2, eval_nodes=0, resume=str(tmp_path / "ck")), nprocs=2)[0]
    assert [h["aggregate"]["loss"] for h in rest["history"]] == [h["aggregate"]["loss"] for h in whole["history"]]
