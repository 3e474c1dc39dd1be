"""`NeighborLoader` with a `FeatureStore` for features (and labels): the same batches as with plain tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from datapath.features import FeatureStore, presample_hotness
from datapath.graph import generate
from datapath.loaders import LoaderError, NeighborLoader


@pytest.fixture(scope="module")
def tiny():
    return generate("tiny", progress=False, device="cpu")


@pytest.mark.parametrize("prefetch", [0, 1])
def test_store_batches_equal_tensor_batches(tmp_path, tiny, prefetch: int) -> None:
    np.save(tmp_path / "f.npy", tiny.features.numpy())
    np.save(tmp_path / "y.npy", tiny.labels.numpy())
    hot = presample_hotness(tiny.graph, tiny.train_idx, [10, 5], batch_size=512, batches=6)
    feats = FeatureStore(tmp_path / "f.npy", gpu_cache="10%", host_memory="20%", hotness=hot, device="cpu")
    labels = FeatureStore(tmp_path / "y.npy", host_memory="50%", hotness=hot, device="cpu")
    kw = dict(shuffle=True, seed=4, device="cpu", prefetch=prefetch)
    loader = NeighborLoader(tiny.graph, tiny.train_idx, [10, 5], 700, features=feats, labels=labels, **kw)
    ref = NeighborLoader(tiny.graph, tiny.train_idx, [10, 5], 700, features=tiny.features, labels=tiny.labels, **kw)
    batches = 0
    for a, b in zip(loader, ref):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.seeds, b.seeds)
        batches += 1
    assert batches == len(loader) == len(ref)
    st = feats.stats()
    assert st["disk"]["rows"] > 0 and st["gpu_cache"]["hit_rate"] > 0.1
    assert labels.stats()["disk"]["rows"] > 0
    feats.close()
    labels.close()


def test_store_rows_must_match_the_graph(tiny) -> None:
    small = FeatureStore(tiny.features[:100], device="cpu")
    with pytest.raises(LoaderError, match="features has 100 rows"):
        NeighborLoader(tiny.graph, tiny.train_idx, [5], 64, features=small, device="cpu")
