"""HeteroNeighborLoader: each node type's rows from its own table, labels of the seeds, every seed once per epoch."""
from __future__ import annotations

import pytest
import torch

from datapath.loaders import HeteroNeighborLoader, LoaderError, hetero_cache_rows, hetero_hotness
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


def test_bad_tables_types_and_relations_are_named(hetero) -> None:
    """Each bad input is one `LoaderError` naming the node type or relation, raised when the loader is built."""
    from datapath.features import FeatureStore

    hg, n, _ = hetero(12)
    seeds = ("paper", torch.arange(5))
    with pytest.raises(LoaderError, match="'author'"):
        HeteroNeighborLoader(hg, seeds, [2], features={"author": torch.randn(n["author"] + 1, 2)}, device="cpu")
    with pytest.raises(LoaderError, match="'venue'"):
        HeteroNeighborLoader(hg, seeds, [2], features={"venue": torch.randn(3, 2)}, device="cpu")
    with pytest.raises(LoaderError, match="'paper'"):
        HeteroNeighborLoader(hg, seeds, [2], labels=torch.zeros(3, dtype=torch.long), device="cpu")
    with pytest.raises(LoaderError, match="'author' must be \\(num_nodes, F\\)"):
        HeteroNeighborLoader(hg, seeds, [2], features={"author": torch.randn(n["author"])}, device="cpu")
    store = FeatureStore(torch.randn(n["fos"] + 2, 4), device="cpu")
    with pytest.raises(LoaderError, match="'fos' have 13 rows"):
        HeteroNeighborLoader(hg, seeds, [2], features={"fos": store}, device="cpu")
    with pytest.raises(LoaderError, match="'venue'"):
        HeteroNeighborLoader(hg, ("venue", torch.arange(2)), [2], device="cpu")
    with pytest.raises(LoaderError, match="'author'.*40 nodes"):
        HeteroNeighborLoader(hg, ("author", torch.tensor([0, 40])), [2], device="cpu")
    with pytest.raises(LoaderError, match="likes"):  # at construction, not in the producer thread
        HeteroNeighborLoader(hg, seeds, {"likes": [2]}, device="cpu")


def test_hotness_counts_presampled_reads(hetero) -> None:
    hg, n, _ = hetero(13, scale=2)
    hot = hetero_hotness(hg, ("paper", torch.arange(40)), HeteroNeighborSampler([3, 2]), batch_size=8, batches=3)
    assert set(hot) == set(n) and all(hot[t].shape == (n[t],) for t in n)
    deg = {t: sum((torch.bincount(hg[et].indices.long(), minlength=n[t]) for et in hg.edge_types if et[0] == t),
                  torch.zeros(n[t], dtype=torch.int64)) for t in n}
    scale = 1 + max(int(d.max()) for d in deg.values())  # one scale for every type: scores compare across types
    for t in n:
        assert torch.equal(hot[t] % scale, deg[t])  # ties broken by degree, below the presample counts
    read = hot["paper"] // scale
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


def test_cache_rows_spend_one_budget_hottest_per_byte_first() -> None:
    g = torch.Generator().manual_seed(3)
    n = {"paper": 300, "author": 500, "institute": 7, "fos": 40}
    hot = {t: torch.randint(0, 50, (c,), generator=g) for t, c in n.items()}
    hot["institute"] += 100  # a small type every batch reads: cached whole before the big types' cold rows
    row_bytes = {"paper": 512, "author": 256, "institute": 512, "fos": 1024}
    total = sum(n[t] * row_bytes[t] for t in n)
    for share in (0.0, 0.1, 0.25, 0.6, 1.0):
        budget = int(share * total)
        rows = hetero_cache_rows(hot, row_bytes, budget)
        # reference: every row of every type by score per byte (type order, then id, breaks ties), taken while it fits
        ranked = sorted(((-float(hot[t][i]) / row_bytes[t], k, i, t) for k, t in enumerate(n) for i in range(n[t])))
        want, spent = dict.fromkeys(n, 0), 0
        for _, _, _, t in ranked:
            if spent + row_bytes[t] > budget:
                break
            spent += row_bytes[t]
            want[t] += 1
        assert rows == want
        assert sum(rows[t] * row_bytes[t] for t in n) <= budget
        if share >= 0.1:
            assert rows["institute"] == n["institute"]
    assert hetero_cache_rows(hot, {"paper": 512}, 10**9) == {"paper": n["paper"]}  # types without a table: none
    with pytest.raises(LoaderError, match="'venue'"):
        hetero_cache_rows(hot, {"venue": 64}, 100)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_on", ["cuda", "unified"])
def test_gpu_batches_equal_the_cpu_loaders(hetero, cuda_device, graph_on) -> None:
    """The GPU producer (sampling, gather and prepare streams; tiered stores) gives the CPU loader's batches."""
    from datapath.features import FeatureStore
    from datapath.nn import HeteroGNN

    hg, n, _ = hetero(15, scale=6)
    g = torch.Generator().manual_seed(4)
    feats = {t: torch.randn(c, 16, generator=g) for t, c in n.items() if t != "institute"}
    labels = torch.randint(0, 5, (n["paper"],), generator=g)
    seeds = ("paper", torch.randperm(n["paper"], generator=g)[:200])
    sampler = HeteroNeighborSampler([4, 3], seed=9)
    hot = hetero_hotness(hg, seeds, sampler, batch_size=32, batches=3)
    stores = {t: FeatureStore(x.clone(), gpu_cache="25%", hotness=hot[t], device=cuda_device) for t, x in feats.items()}
    model = HeteroGNN("rgat", hg.metadata, {t: 16 for t in feats}, n, 8, 5, heads=2).to(cuda_device)
    kw = dict(batch_size=32, shuffle=True, seed=2)
    want = list(HeteroNeighborLoader(hg, seeds, sampler, features=feats, labels=labels, device="cpu", **kw))
    for gather_stream, workers in (("own", 1), ("sample", 1), ("serial", 1), ("own", 2)):
        loader = HeteroNeighborLoader(hg.to(graph_on), seeds, sampler, features=stores, labels=labels.to(cuda_device),
                                      device=cuda_device, prefetch=2, num_workers=workers, gather_stream=gather_stream,
                                      prepare=model.prepare_batch, **kw)
        got = list(loader)
        assert len(got) == len(want) == 7
        for a, b in zip(want, got):
            assert torch.equal(a.seeds, b.seeds.cpu()) and torch.equal(a.y, b.y.cpu())
            for la, lb in zip(a.blocks, b.blocks):
                for t in la.src_nodes:
                    assert torch.equal(la.src_nodes[t], lb.src_nodes[t].cpu()), (gather_stream, t)
                for et, r in la.relations.items():
                    assert torch.equal(r.indptr, lb.relations[et].indptr.cpu())
                    assert torch.equal(r.indices, lb.relations[et].indices.cpu()), (gather_stream, et)
            for t in feats:
                assert b.x[t].device == cuda_device and torch.equal(a.x[t], b.x[t].cpu()), (gather_stream, t)
            out = model(b.blocks, b.x)  # the prepared relations serve the step
            assert out.shape == (b.seeds.numel(), 5) and bool(torch.isfinite(out).all())


def test_relational_models_train_in_one_process(monkeypatch) -> None:
    from datapath.apps.train_gnn import TrainConfig
    from datapath.apps.train_hetero import train_hetero

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one process"):
        train_hetero(TrainConfig(dataset="igbh-tiny", model="rgat"))
