"""HeteroNeighborLoader: each node type's rows from its own table, labels of the seeds, every seed once per epoch."""
from __future__ import annotations

import pytest
import torch

from datapath.loaders import HeteroNeighborLoader, LoaderError, hetero_hotness
from datapath.sampling import HeteroNeighborSampler


@pytest.mark.parametrize("prefetch,workers", [(0, 1), (2, 1), (1, 3)])
def test_batches_carry_each_types_rows(hetero, prefetch, workers) -> None:
    hg, n, _ = hetero(11, scale=2)
    g = torch.Generator().manual_seed(0)
    feats = {"paper": torch.randn(n["paper"], 6, generator=g), "author": torch.randn(n["author"], 3, generator=g)}
    labels = torch.randint(0, 5, (n["paper"],), generator=g)
    seeds = torch.randperm(n["paper"], generator=g)[:50]
    loader = HeteroNeighborLoader(hg, ("paper", seeds), [3, 2], batch_size=16, shuffle=True, features=feats,
                                  labels=labels, device="cpu", prefetch=prefetch, num_workers=workers)
    seen = []
    for batch in loader:
        assert set(batch.x) == {"paper", "author"}
        for t, x in batch.x.items():
            assert torch.equal(x, feats[t][batch.input_nodes[t]])
        assert torch.equal(batch.y, labels[batch.seeds])
        assert torch.equal(batch.blocks[-1].dst_nodes("paper"), batch.seeds)
        seen.append(batch.seeds)
    assert len(seen) == len(loader) == 4
    assert sorted(torch.cat(seen).tolist()) == sorted(seeds.tolist())
    again = HeteroNeighborLoader(hg, ("paper", seeds), [3, 2], batch_size=16, shuffle=True, features=feats,
                                 labels=labels, device="cpu", prefetch=0)
    assert [b.seeds.tolist() for b in again] == [s.tolist() for s in seen]  # in order, whatever the workers


def test_bad_tables_are_named(hetero) -> None:
    hg, n, _ = hetero(12)
    seeds = ("paper", torch.arange(5))
    with pytest.raises(LoaderError, match="'author'"):
        HeteroNeighborLoader(hg, seeds, [2], features={"author": torch.randn(n["author"] + 1, 2)}, device="cpu")
    with pytest.raises(LoaderError, match="'venue'"):
        HeteroNeighborLoader(hg, seeds, [2], features={"venue": torch.randn(3, 2)}, device="cpu")
    with pytest.raises(LoaderError, match="'paper'"):
        HeteroNeighborLoader(hg, seeds, [2], labels=torch.zeros(3, dtype=torch.long), device="cpu")


def test_hotness_counts_presampled_reads(hetero) -> None:
    hg, n, _ = hetero(13, scale=2)
    hot = hetero_hotness(hg, ("paper", torch.arange(40)), HeteroNeighborSampler([3, 2]), batch_size=8, batches=3)
    assert set(hot) == set(n) and all(hot[t].shape == (n[t],) for t in n)
    deg = sum(torch.bincount(hg[et].indices.long(), minlength=n["paper"]) for et in hg.edge_types if et[0] == "paper")
    read = hot["paper"] // (int(deg.max()) + 1)  # the presample counts (ties broken by degree below them)
    assert torch.equal(hot["paper"] % (int(deg.max()) + 1), deg)
    assert (read > 0).sum() >= 24 and int(read.max()) <= 3  # 3 batches of 8 distinct seeds, each read at most 3 times


def test_feature_stores_serve_the_same_batches(hetero) -> None:
    from datapath.features import FeatureStore

    hg, n, _ = hetero(14, scale=3)
    g = torch.Generator().manual_seed(2)
    feats = {t: torch.randn(c, 8, generator=g) for t, c in n.items()}
    hot = hetero_hotness(hg, ("paper", torch.arange(90)), HeteroNeighborSampler([3, 2]), batch_size=16, batches=4)
    stores = {t: FeatureStore(x.clone(), gpu_cache="25%", hotness=hot[t], device="cpu") for t, x in feats.items()}
    kw = dict(batch_size=16, shuffle=True, device="cpu", seed=5)
    plain = HeteroNeighborLoader(hg, ("paper", torch.arange(90)), [3, 2], features=feats, **kw)
    tiered = HeteroNeighborLoader(hg, ("paper", torch.arange(90)), [3, 2], features=stores, **kw)
    for a, b in zip(plain, tiered, strict=True):
        assert a.x.keys() == b.x.keys()
        for t in a.x:
            assert torch.equal(a.x[t], b.x[t])


def test_relational_models_train_in_one_process(monkeypatch) -> None:
    from datapath.apps.train_gnn import TrainConfig
    from datapath.apps.train_hetero import train_hetero

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one process"):
        train_hetero(TrainConfig(dataset="igbh-tiny", model="rgat"))
