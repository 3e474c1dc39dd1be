"""The main job: `datapath train-gnn` trains to clearly-better-than-chance accuracy."""
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
def test_default_job_learns(tmp_path, capsys) -> None:
    res = _run(tmp_path, "--epochs", "2", "--device", "cpu")
    text = capsys.readouterr().out
    assert "dataset tiny" in text and "test accuracy" in text and "sample" in text and "CPU" in text
    assert res["dataset"] == "tiny" and len(res["epochs"]) == 2
    first, last = (e["aggregate"] for e in res["epochs"])
    assert last["loss"] < first["loss"]
    assert last["val_acc"] > 0.5 and res["test_acc"] > 0.5  # chance is 1/8
    assert last["epoch_s"] > 0 and last["cpu_s"] > 0 and last["batches"] == 20


@pytest.mark.slow
def test_gat_and_dataset_directory(tmp_path) -> None:
    assert main(["prepare-dataset", "tiny", str(tmp_path / "tiny"), "--device", "cpu"]) == 0
    res = _run(tmp_path, "--dataset", str(tmp_path / "tiny"), "--model", "gat", "--epochs", "1",
               "--max-batches", "8", "--fanouts", "5,5", "--device", "cpu", "--features-on", "unified")
    assert res["model"] == "gat" and res["epochs"][0]["aggregate"]["batches"] == 8
    assert res["test_acc"] > 0.25


@pytest.mark.slow
def test_dataset_beyond_host_memory_with_superbatches(tmp_path) -> None:
    """--host-memory below the features: the rest is read from features.npy a superbatch at a time, and the
    run trains exactly as with every row in host memory (same losses: the rows read are the table's)."""
    data = tmp_path / "papers"
    assert main(["prepare-dataset", "papers", str(data), "--memory-gb", "0.25", "--device", "cpu"]) == 0
    common = ["--dataset", str(data), "--epochs", "1", "--max-batches", "3", "--device", "cpu",
              "--fanouts", "5,5", "--eval-nodes", "0"]
    ref = _run(tmp_path, *common, "--host-memory", "100%")
    got = _run(tmp_path, *common, "--host-memory", "90%", "--disk-superbatch", "20%")
    tiers = json.dumps(got)
    assert '"disk"' in tiers and "staging" in tiers
    assert [e["aggregate"]["loss"] for e in got["epochs"]] == [e["aggregate"]["loss"] for e in ref["epochs"]]


def test_superbatch_needs_host_memory_and_a_directory(tmp_path) -> None:
    assert main(["train-gnn", "--device", "cpu", "--disk-superbatch", "20%", "--no-progress"]) == 2


def test_cpu_device_rejects_cuda_placement(tmp_path, capsys) -> None:
    assert main(["train-gnn", "--device", "cpu", "--features-on", "cuda", "--no-progress"]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("features_on", ["unified", "cuda", "cpu"])
def test_gpu_job(tmp_path, features_on) -> None:
    res = _run(tmp_path, "--epochs", "2", "--features-on", features_on)
    assert res["device"] == "cuda" and res["epochs"][-1]["aggregate"]["peak_gpu_bytes"] > 0
    assert res["test_acc"] > 0.5
    assert torch.cuda.is_available()
