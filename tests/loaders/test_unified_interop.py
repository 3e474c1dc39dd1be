"""Loaders over `datapath.unified_tensor` tensors (``as_unified``: pinned in place, no copy)."""
from __future__ import annotations

import pytest
import torch

from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.sampling import NeighborSampler

ut = pytest.importorskip("datapath.unified_tensor")


def _data(n: int = 1200, e: int = 15000, f: int = 19):
    g = torch.Generator().manual_seed(11)
    base = Graph.from_edge_index(torch.randint(0, n, (2, e), generator=g), n)
    return base, torch.randn(n, f, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_graph_and_features_pinned_in_place() -> None:
    base, feats, labels = _data()
    g = Graph(ut.as_unified(base.indptr), ut.as_unified(base.indices))
    assert g.placement == "unified" and ut.is_unified(g.indices)
    assert ut.host_tensor(g.indices).data_ptr() == base.indices.data_ptr()  # no copy
    assert torch.equal(g.in_degrees(), base.in_degrees())
    seeds = torch.arange(0, 1200, 4)
    ref = NeighborSampler([5, 3], seed=2).sample(base, seeds)
    got = NeighborSampler([5, 3], seed=2).sample(g, seeds)
    for a, b in zip(ref, got):
        assert torch.equal(a.src_nodes, b.src_nodes) and torch.equal(a.indices, b.indices)
    loader = NeighborLoader(g, seeds, [4, 4], 100, features=ut.as_unified(feats), labels=ut.as_unified(labels),
                            device="cpu")
    for b in loader:
        assert torch.equal(b.x, feats[b.input_nodes]) and torch.equal(b.y, labels[b.seeds])


@pytest.mark.gpu
def test_gpu_zero_copy_from_unified_tensors(cuda_device) -> None:
    base, feats, labels = _data()
    g = Graph(ut.as_unified(base.indptr), ut.as_unified(base.indices))
    seeds = torch.arange(0, 1200, 4)
    loader = NeighborLoader(g, seeds, NeighborSampler([5, 3], seed=2), 100, features=ut.as_unified(feats),
                            labels=ut.as_unified(labels), device="cuda", prefetch=2)
    ref = NeighborLoader(base, seeds, NeighborSampler([5, 3], seed=2), 100, features=feats, labels=labels,
                         device="cpu")
    assert loader.sample_device.type == "cuda"
    for a, b in zip(ref, loader, strict=True):
        assert torch.equal(a.x, b.x.cpu()) and torch.equal(a.y, b.y.cpu())
        assert torch.equal(a.blocks[0].src_nodes, b.blocks[0].src_nodes.cpu())
