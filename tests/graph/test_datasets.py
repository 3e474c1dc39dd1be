"""Synthetic datasets: determinism, shape, power law, learnable labels, .npy directories."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from datapath.graph import (
    PRESETS,
    DatasetError,
    SyntheticSpec,
    generate,
    get_dataset,
    load_dataset,
    papers_spec,
    prepare_dataset,
    preset_spec,
)

SMALL = SyntheticSpec("small", 3000, 30000, 16, 5, homophily=0.8, signal=0.2, seed=4)


@pytest.fixture(scope="module")
def small():
    return generate(SMALL, device="cpu", progress=False)


def test_deterministic_and_seed_dependent(small) -> None:
    other = generate(dataclasses.replace(SMALL, seed=5), device="cpu", progress=False)
    same = generate(SMALL, device="cpu", progress=False)
    for name in ("features", "labels", "train_idx"):
        assert torch.equal(getattr(small, name), getattr(same, name))
    assert torch.equal(small.graph.indices, same.graph.indices)
    assert not torch.equal(small.features, other.features)


def test_large_graphs_deduplicate_in_destination_ranges(small) -> None:
    """The path for more than 2^31 edge entries (sorted in pieces) builds the same graph."""
    pieces = generate(SMALL, device="cpu", progress=False, sort_limit=7000)
    assert torch.equal(pieces.graph.indptr, small.graph.indptr)
    assert torch.equal(pieces.graph.indices, small.graph.indices)


@pytest.mark.slow
def test_structure(small) -> None:
    g = small.graph
    ei = g.edge_index()
    assert g.num_nodes == 3000 and small.features.shape == (3000, 16) and small.num_classes == 5
    assert (ei[0] != ei[1]).all(), "no self loops"
    keys = ei[1] * 3000 + ei[0]
    assert keys.unique().numel() == keys.numel(), "no duplicate edges"
    rev = ei[0] * 3000 + ei[1]
    assert torch.equal(keys.sort().values, rev.sort().values), "undirected: both directions present"
    deg = g.in_degrees().float()
    assert deg.max() > 8 * deg.median(), "power-law degrees have hubs"
    homophily = (small.labels[ei[0]] == small.labels[ei[1]]).float().mean()
    assert 0.75 < homophily < 0.9  # planted 0.8 (plus chance agreements)
    splits = torch.cat([small.train_idx, small.val_idx, small.test_idx])
    assert splits.unique().numel() == splits.numel()


def test_labels_are_learnable_from_neighbourhoods(small) -> None:
    """Mean of neighbour features predicts the label much better than a node's own features."""
    g = small.graph
    ei = g.edge_index()
    agg = torch.zeros_like(small.features).index_add_(0, ei[1], small.features[ei[0]])
    agg /= g.in_degrees().clamp(min=1)[:, None].float()
    cent = torch.stack([small.features[small.train_idx][small.labels[small.train_idx] == c].mean(0)
                        for c in range(5)])
    y = small.labels[small.test_idx]
    own = ((small.features[small.test_idx] @ cent.T).argmax(1) == y).float().mean()
    nbr = ((agg[small.test_idx] @ cent.T).argmax(1) == y).float().mean()
    assert 0.3 < own < 0.6 and nbr > own + 0.15  # chance is 0.2


def test_save_and_load(small, tmp_path) -> None:
    small.save(tmp_path / "d")
    back = load_dataset(tmp_path / "d")
    assert torch.equal(back.features, small.features) and torch.equal(back.labels, small.labels)
    assert torch.equal(back.graph.indices, small.graph.indices) and back.num_classes == 5
    assert isinstance(np.load(tmp_path / "d" / "features.npy", mmap_mode="r"), np.memmap)
    assert get_dataset(tmp_path / "d").graph.num_edges == small.graph.num_edges


def test_prepare_dataset_writes_a_loadable_directory(tmp_path) -> None:
    d = prepare_dataset("tiny", tmp_path / "tiny", device="cpu", progress=False)
    ds = load_dataset(d)
    ref = generate("tiny", device="cpu", progress=False)
    assert torch.equal(ds.features, ref.features) and torch.equal(ds.graph.indptr, ref.graph.indptr)
    assert json.loads((d / "meta.json").read_text())["spec"]["name"] == "tiny"


def test_broken_directories(tmp_path, small) -> None:
    with pytest.raises(DatasetError, match="prepare-dataset"):
        load_dataset(tmp_path / "nowhere")
    small.save(tmp_path / "d")
    (tmp_path / "d" / "labels.npy").unlink()
    with pytest.raises(DatasetError, match="labels.npy"):
        load_dataset(tmp_path / "d")
    small.save(tmp_path / "e")
    np.save(tmp_path / "e" / "train_idx.npy", np.array([0, 10**6]))
    with pytest.raises(DatasetError, match="train_idx"):
        load_dataset(tmp_path / "e")


def test_presets_and_papers_scaling() -> None:
    assert preset_spec("products").num_nodes == 2_449_029 and PRESETS["products"].num_features == 100
    assert preset_spec("reddit").num_features == 602
    p = papers_spec(64.0)
    feat_bytes = p.num_nodes * p.num_features * 4
    assert 0.7 * 64 * 2**30 < feat_bytes < 64 * 2**30 and p.num_features == 128
    assert papers_spec(10_000).num_nodes == 111_059_956
    with pytest.raises(DatasetError, match="unknown"):
        preset_spec("cora")
    with pytest.raises(DatasetError, match="too small"):
        papers_spec(1e-6)


_OVERWRITE_THEN_HANG = r"""
import sys, time
import datapath.graph.presets as presets
from datapath.graph import prepare_dataset

real = presets.generate

def slow_generate(*args, **kwargs):
    ds = real(*args, **kwargs)  # the new features are already in the (temporary) features.npy
    print("generated", flush=True)
    time.sleep(120)  # killed here
    return ds

presets.generate = slow_generate
prepare_dataset("tiny", sys.argv[1], seed=0, device="cpu", progress=False, overwrite=True)
"""


@pytest.mark.slow
def test_an_overwrite_killed_midway_leaves_the_old_dataset(tmp_path) -> None:
    """The data-loss case: prepare-dataset into a directory that holds a dataset, killed with SIGKILL."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    d = tmp_path / "D"
    prepare_dataset("tiny", d, seed=1, device="cpu", progress=False)
    before = load_dataset(d)
    old_x = before.features[:50].clone()
    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.Popen([sys.executable, "-c", _OVERWRITE_THEN_HANG, str(d)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(src)})
    try:
        assert proc.stdout.readline().strip() == "generated"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    after = load_dataset(d)  # the old dataset, whole
    assert torch.equal(after.features[:50], old_x) and after.features.abs().sum() > 0
    assert torch.equal(after.labels, before.labels) and torch.equal(after.graph.indices, before.graph.indices)
    # the next write clears what the killed one left beside the target
    prepare_dataset("tiny", d, seed=0, device="cpu", progress=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D"]
    assert not torch.equal(load_dataset(d).features[:50], old_x)


def test_prepare_refuses_a_non_empty_directory_without_overwrite(tmp_path) -> None:
    d = tmp_path / "D"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare_dataset("tiny", d, device="cpu", progress=False)
    assert (d / "notes.txt").read_text() == "mine"


def test_damaged_datasets_name_the_file(tmp_path) -> None:
    import os

    d = tmp_path / "D"
    prepare_dataset("tiny", d, device="cpu", progress=False)
    f = d / "features.npy"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(DatasetError, match="features.npy has .* bytes but meta.json recorded"):
        load_dataset(d)
    prepare_dataset("tiny", d, device="cpu", progress=False, overwrite=True)
    (d / "labels.npy").unlink()
    with pytest.raises(DatasetError, match="labels.npy"):
        load_dataset(d)


def test_labels_outside_the_classes_are_caught_at_load(tmp_path) -> None:
    ds = generate(SMALL, device="cpu", progress=False)
    ds.labels[7] = 99
    ds.save(tmp_path / "D")
    with pytest.raises(DatasetError, match=r"labels.npy holds labels in \[0, 99\] but meta.json says num_classes=5"):
        load_dataset(tmp_path / "D")


def test_a_truncated_npy_without_manifest_names_the_file(tmp_path) -> None:
    """Datasets written before the manifest existed still get an error that names the file."""
    import json
    import os

    d = tmp_path / "D"
    generate(SMALL, device="cpu", progress=False).save(d)
    meta = json.loads((d / "meta.json").read_text())
    meta.pop("files")
    (d / "meta.json").write_text(json.dumps(meta))
    os.truncate(d / "indices.npy", 100)
    with pytest.raises(DatasetError, match="indices.npy cannot be read"):
        load_dataset(d)
