"""GraphSAGE / GAT over sampled blocks: shapes, agreement with PyG layers, training."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.sampling import NeighborSampler
from datapath.nn.models import GAT, GraphSAGE, build_model

pyg = pytest.importorskip("torch_geometric")


def _loader(device: str = "cpu", prepare=None, prefetch: int = 1, batch_size: int = 50, n: int = 600,
            f: int = 12) -> NeighborLoader:
    g = torch.Generator().manual_seed(0)
    src, dst = torch.randint(0, n, (2, 9000), generator=g)
    keep = src != dst
    graph = Graph.from_edge_index(torch.stack([src[keep], dst[keep]]), n)
    feats = torch.randn(n, f, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    if device == "cuda":
        graph = graph.to("cuda")
        feats, labels = feats.cuda(), labels.cuda()
    return NeighborLoader(graph, torch.arange(0, n, 3), NeighborSampler([6, 4, 3], seed=1), batch_size,
                          features=feats, labels=labels, device=device, prepare=prepare, prefetch=prefetch)


def _batch(device: str = "cpu"):
    return next(iter(_loader(device, batch_size=100)))


@pytest.mark.parametrize("name", ["sage", "gat"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_datapath_and_pyg_backends_agree(name: str, device: str) -> None:
    batch = _batch(device)
    torch.manual_seed(0)
    ours = build_model(name, 12, 32, 4, num_layers=3, dropout=0.0, heads=4).to(device).eval()
    theirs = build_model(name, 12, 32, 4, num_layers=3, dropout=0.0, heads=4, backend="pyg").to(device).eval()
    theirs.load_state_dict(ours.state_dict())
    out = ours(batch.blocks, batch.x)
    ref = theirs(batch.blocks, batch.x)
    assert out.shape == (100, 4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [GraphSAGE, GAT])
def test_models_train_on_batches(cls) -> None:
    batch = _batch()
    torch.manual_seed(1)
    model = cls(12, 32, 4, num_layers=3, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first  # memorizes one batch


def test_bad_inputs() -> None:
    batch = _batch()
    model = GraphSAGE(12, 16, 4, num_layers=2)
    with pytest.raises(ValueError, match="layers"):
        model(batch.blocks, batch.x)
    model3 = GraphSAGE(12, 16, 4, num_layers=3)
    with pytest.raises(ValueError, match="rows"):
        model3(batch.blocks, batch.x[:-1])
    with pytest.raises(ValueError, match="multiple of heads"):
        GAT(12, 30, 4, heads=4)
    with pytest.raises(ValueError, match="backend"):
        GraphSAGE(12, 16, 4, backend="dgl")
    with pytest.raises(ValueError, match="model"):
        build_model("gcn", 12, 16, 4, 2)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_loader_prepare_hook_runs_per_batch_and_its_tensors_travel(prefetch: int) -> None:
    seen = []
    extra = torch.randn(7)

    def prepare(batch):
        seen.append(batch.seeds.clone())
        return [extra]
    batches = list(_loader("cpu", prepare, prefetch))
    assert len(seen) == len(batches) == 4
    for b, s in zip(batches, seen):
        assert torch.equal(b.seeds, s)
        assert any(t is extra for t in b.tensors())
    model = GraphSAGE(12, 32, 4, num_layers=3)
    assert model.prepare_batch(batches[0]) == []  # the CPU kernels need no schedule


def test_loader_prepare_errors_reach_the_consumer() -> None:
    def prepare(batch):
        raise ValueError("bad batch")
    with pytest.raises(ValueError, match="bad batch"):
        list(_loader("cpu", prepare, prefetch=1))


@pytest.mark.gpu
def test_prepared_batches_train_without_a_host_sync_and_match() -> None:
    """A GraphSAGE step on CUDA never synchronises; with the schedules built by the loader
    (``prepare``) it builds none of them itself; same loss and gradients either way."""
    import contextlib

    from datapath.ops import cached_keys

    @contextlib.contextmanager
    def no_sync():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising torch op raises
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    torch.manual_seed(2)
    model = GraphSAGE(12, 32, 4, num_layers=3, dropout=0.0).cuda()
    twin = GraphSAGE(12, 32, 4, num_layers=3, dropout=0.0).cuda()
    twin.load_state_dict(model.state_dict())
    prepared = list(_loader("cuda", model.prepare_batch))
    plain = list(_loader("cuda"))
    assert all(b._prepared for b in prepared)
    for a, b in zip(prepared, plain):
        before = [set(map(repr, cached_keys(blk))) for blk in a.blocks]
        assert all(any("transposed" in k for k in keys) for keys in before[1:])
        with no_sync():
            loss = F.cross_entropy(model(a.blocks, a.x), a.y)
            loss.backward()
        assert [set(map(repr, cached_keys(blk))) for blk in a.blocks] == before  # every schedule came with the batch
        assert not any(cached_keys(blk) for blk in b.blocks)
        with no_sync():  # without them the step builds them, still without waiting for the GPU
            ref = F.cross_entropy(twin(b.blocks, b.x), b.y)
            ref.backward()
        assert any("transposed" in repr(k) for k in cached_keys(b.blocks[-1]))
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        model.zero_grad()
        twin.zero_grad()
