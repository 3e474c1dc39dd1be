"""`datapath train-gnn --gpu-cache ... --host-memory ...`: the features come through a FeatureStore."""
from __future__ import annotations

import json

import pytest
import torch

from datapath.cli import main


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "run.json"
    assert main(["train-gnn", "--no-progress", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_store_options_train_from_disk(tmp_path, capsys) -> None:
    assert main(["prepare-dataset", "tiny", str(tmp_path / "tiny"), "--device", "cpu"]) == 0
    res = _run(tmp_path, "--dataset", str(tmp_path / "tiny"), "--epochs", "2", "--device", "cpu",
               "--gpu-cache", "10%", "--host-memory", "25%", "--cache-policy", "degree")
    text = capsys.readouterr().out
    assert "feature store" in text and "disk" in text
    assert res["features_on"] == "feature_store" and res["feature_store"]["disk"]["rows"] == 13_000
    assert res["test_acc"] > 0.5


@pytest.mark.parametrize("bad,flag", [(["--gpu-cache", "lots"], "--gpu-cache"), (["--host-memory", "-1GB"],
                                                                              "--host-memory"),
                                      (["--gpu-cache", "150%"], "--gpu-cache")])
def test_bad_budgets_name_the_flag(capsys, bad: list[str], flag: str) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse: one "error:" line, exit 2, before any work
        main(["train-gnn", "--device", "cpu", "--no-progress", *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") <= 2


def test_store_and_features_on_exclude_each_other(capsys) -> None:
    assert main(["train-gnn", "--device", "cpu", "--no-progress", "--gpu-cache", "10%", "--features-on",
                 "unified"]) != 0
    assert "features_on" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_job_with_cache_and_disk(tmp_path) -> None:
    assert main(["prepare-dataset", "tiny", str(tmp_path / "tiny")]) == 0
    res = _run(tmp_path, "--dataset", str(tmp_path / "tiny"), "--epochs", "2", "--gpu-cache", "25%",
               "--host-memory", "25%")
    assert res["device"] == "cuda" and res["graph_on"] == "cuda" and res["test_acc"] > 0.5
    st = res["feature_store_stats"]
    assert st["gpu_cache"]["hit_rate"] > 0.3 and st["disk"]["rows"] > 0
    assert torch.cuda.is_available()
