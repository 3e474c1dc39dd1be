"""Hetero presets (IGBH/MAG-shaped) and train-gnn --model rgat|rgcn|hgt on them (CPU)."""
from __future__ import annotations

import contextlib
import json
import resource

import pytest
import torch

from datapath.apps.train_gnn import TrainConfig, run_training
from datapath.graph import HETERO_PRESETS, HeteroData, HeteroGraph, HeteroSpec, generate_hetero


def _small_spec() -> HeteroSpec:
    base = HETERO_PRESETS["igbh-tiny"]
    return HeteroSpec("small-test", {t: max(8, n // 10) for t, n in base.num_nodes.items()},
                      {et: max(16, m // 10) for et, m in base.edges.items()}, {t: 32 for t in base.num_nodes}, 5,
                      reverse=base.reverse, signal={t: 0.3 for t in base.num_nodes})


def test_generated_dataset_shape_and_roundtrip(tmp_path) -> None:
    spec = _small_spec()
    data = generate_hetero(spec, seed=1)
    hg = data.graph
    assert hg.num_nodes == spec.num_nodes
    assert len(hg.edge_types) == len(spec.edges) + len(spec.reverse)
    for (s, name, d), m in spec.edges.items():
        assert 0.5 * m <= hg[(s, name, d)].num_edges <= m  # parallel edges dropped
        rev = (d, f"rev_{name}", s)
        if name not in spec.reverse:
            continue
        assert sorted(map(tuple, hg[rev].edge_index().flip(0).t().tolist())) == \
            sorted(map(tuple, hg[(s, name, d)].edge_index().t().tolist()))
    assert all(x.shape == (spec.num_nodes[t], 32) for t, x in data.features.items())
    assert int(data.labels.max()) < 5 and data.train_idx.numel() + data.val_idx.numel() + data.test_idx.numel() \
        == spec.num_nodes["paper"]
    back = HeteroData.load(data.save(tmp_path / "d"))
    assert back.graph.edge_types == hg.edge_types and torch.equal(back.features["author"], data.features["author"])
    assert torch.equal(back.labels, data.labels) and back.num_classes == 5


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail with EFBIG in this process (CPython ignores SIGXFSZ): a save cut off midway."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _same(a: HeteroData, b: HeteroData) -> bool:
    return (torch.equal(a.labels, b.labels) and a.features.keys() == b.features.keys()
            and all(torch.equal(a.features[t], b.features[t]) for t in a.features)
            and all(torch.equal(a.graph[et].indices, b.graph[et].indices) for et in a.graph.edge_types))


def test_an_interrupted_save_leaves_no_half_dataset(tmp_path) -> None:
    spec = _small_spec()
    data, old = generate_hetero(spec, seed=1), generate_hetero(spec, seed=2)
    target = tmp_path / "d"
    big = max(x.numel() * x.element_size() for x in data.features.values())
    small = min(x.numel() * x.element_size() for x in data.features.values())
    limit = (big + small) // 2  # the graph and the small feature tables fit, the largest table does not
    with _file_size_limit(limit), pytest.raises(OSError) as err:
        data.save(target)
    assert str(target / "features_") in str(err.value)  # names the file it could not write, in the target
    assert not target.exists() and list(tmp_path.iterdir()) == []  # nothing, not a graph and some tables
    old.save(target)
    with _file_size_limit(limit), pytest.raises(OSError):
        data.save(target, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary sibling left
    assert _same(HeteroData.load(target), old)  # the dataset that was there, whole
    with pytest.raises(FileExistsError, match="overwrite"):
        data.save(target)
    data.save(target, overwrite=True)
    assert _same(HeteroData.load(target), data)
    with pytest.raises(FileExistsError, match="overwrite"):
        data.graph.save(target)  # the graph alone is written all at once too
    data.graph.save(tmp_path / "g")
    assert HeteroGraph.load(tmp_path / "g").edge_types == data.graph.edge_types


@pytest.mark.slow
@pytest.mark.parametrize("model", ["rgat", "rgcn", "hgt"])
def test_train_gnn_relational_models_learn(tmp_path, model) -> None:
    cfg = TrainConfig(dataset="igbh-tiny", model=model, epochs=2, batch_size=512, fanouts=(5, 3), hidden=32, heads=2,
                      lr=1e-2, eval_nodes=1000, json=str(tmp_path / "r.json"), prefetch=1)
    [result] = run_training(cfg)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["model"] == model and len(doc["history"]) == 2
    assert result["test_acc"] > 3 / 19  # well above chance (1/19)
