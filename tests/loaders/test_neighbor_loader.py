"""NeighborLoader: coverage of the seeds, features/labels, prefetch, shuffling, placements."""
from __future__ import annotations

import threading

import pytest
import torch

from datapath.graph import Graph
from datapath.loaders import LoaderError, NeighborLoader
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler


def _data(n: int = 1500, e: int = 20000, f: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    graph = Graph.from_edge_index(torch.randint(0, n, (2, e), generator=g), n)
    feats = torch.randn(n, f, generator=g)
    labels = torch.randint(0, 7, (n,), generator=g)
    seeds = torch.randperm(n, generator=g)[: n // 2]
    return graph, feats, labels, seeds


def _collect(loader):
    return [(b.seeds.cpu(), [(blk.src_nodes.cpu(), blk.indices.cpu()) for blk in b.blocks],
             b.x.cpu(), b.y.cpu()) for b in loader]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_covers_seeds_with_right_features(prefetch: int, drop_last: bool) -> None:
    graph, feats, labels, seeds = _data()
    loader = NeighborLoader(graph, seeds, NeighborSampler([5, 3]), batch_size=128, shuffle=True,
                            drop_last=drop_last, features=feats, labels=labels, device="cpu", prefetch=prefetch)
    batches = list(loader)
    assert len(batches) == len(loader) == (750 // 128 if drop_last else -(-750 // 128))
    seen = torch.cat([b.seeds for b in batches])
    assert seen.unique().numel() == seen.numel()
    if not drop_last:
        assert torch.equal(seen.sort().values, seeds.sort().values)
    for b in batches:
        assert torch.equal(b.x, feats[b.input_nodes])
        assert torch.equal(b.y, labels[b.seeds])
        assert torch.equal(b.blocks[-1].dst_nodes, b.seeds)
        assert b.x.shape == (b.blocks[0].num_src_nodes, 24)


def test_shuffle_is_seeded_and_changes_per_epoch() -> None:
    graph, feats, labels, seeds = _data()
    mk = lambda: NeighborLoader(graph, seeds, NeighborSampler([4], seed=1), 100, shuffle=True,  # noqa: E731
                                features=feats, labels=labels, device="cpu", seed=5)
    a, b = mk(), mk()
    e0a, e0b = _collect(a), _collect(b)
    for x, y in zip(e0a, e0b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[2], y[2])
    e1a = _collect(a)
    assert not torch.equal(e0a[0][0], e1a[0][0])
    b.set_epoch(1)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(e1a, _collect(b)))
    plain = NeighborLoader(graph, seeds, NeighborSampler([4]), 100, device="cpu")
    assert torch.equal(torch.cat([bt.seeds for bt in plain]), seeds)


def test_prefetch_matches_synchronous() -> None:
    graph, feats, labels, seeds = _data(seed=1)
    mk = lambda p: NeighborLoader(graph, seeds, NeighborSampler([6, 2], seed=2), 64, shuffle=True,  # noqa: E731
                                  features=feats, labels=labels, device="cpu", prefetch=p)
    for (s0, b0, x0, y0), (s1, b1, x1, y1) in zip(_collect(mk(0)), _collect(mk(3))):
        assert torch.equal(s0, s1) and torch.equal(x0, x1) and torch.equal(y0, y1)
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(b0, b1))


class _Broken(NeighborSampler):
    """A sampler that raises at batch ``fail_step``."""

    def __init__(self, fanouts: list[int], fail_step: int) -> None:
        super().__init__(fanouts)
        self.fail_step = fail_step

    def _launch(self, graph, seeds, step):
        if step == self.fail_step:
            raise RuntimeError(f"sampler exploded at batch {step}")
        return super()._launch(graph, seeds, step)


def test_producer_errors_reach_the_consumer() -> None:
    graph, feats, labels, seeds = _data(seed=3)
    loader = NeighborLoader(graph, seeds, _Broken([3], 2), 100, device="cpu", prefetch=2)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(RuntimeError, match="exploded"):
        next(it)


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("datapath-neighbor-loader-") and t.is_alive()]


@pytest.mark.parametrize("workers", [1, 3])
def test_closed_iterator_stops_its_threads(workers: int) -> None:
    graph, feats, labels, seeds = _data(seed=4)
    before = len(_producer_threads())
    it = iter(NeighborLoader(graph, seeds, [3], 10, features=feats, device="cpu", prefetch=2,
                             num_workers=workers))
    next(it)
    assert len(_producer_threads()) == before + workers
    it.close()
    assert len(_producer_threads()) == before
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("workers", [1, 2])
def test_breaking_out_of_the_loop_leaves_no_thread(workers: int) -> None:
    """An evaluation loop with a batch limit breaks out early: the producers must stop with it."""
    graph, feats, labels, seeds = _data(seed=4)
    loader = NeighborLoader(graph, seeds, [3], 10, features=feats, labels=labels, device="cpu", prefetch=2,
                            num_workers=workers)
    before = len(_producer_threads())
    for _ in range(3):
        for i, batch in enumerate(loader):
            assert batch.x.shape[0] == batch.blocks[0].num_src_nodes
            if i == 1:
                break
        assert len(_producer_threads()) == before  # the dropped iterator joined its threads
    it = iter(loader)
    next(it)
    loader.close()  # closes the epochs still being iterated
    assert len(_producer_threads()) == before


@pytest.mark.parametrize("workers", [2, 3])
def test_several_workers_give_the_same_batches_in_order(workers: int) -> None:
    graph, feats, labels, seeds = _data(seed=6)

    def make(w: int) -> NeighborLoader:
        return NeighborLoader(graph, seeds, [4, 3], 37, shuffle=True, features=feats, labels=labels,
                              device="cpu", seed=3, num_workers=w)
    one, many = list(make(1)), list(make(workers))
    assert len(one) == len(many) == len(make(1))
    for a, b in zip(one, many):
        assert torch.equal(a.seeds, b.seeds) and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
        for ba, bb in zip(a.blocks, b.blocks):
            assert torch.equal(ba.indptr, bb.indptr) and torch.equal(ba.indices, bb.indices)
            assert torch.equal(ba.src_nodes, bb.src_nodes)


def test_an_error_in_one_of_several_workers_reaches_the_consumer_in_order() -> None:
    graph, feats, labels, seeds = _data(seed=7)
    it = iter(NeighborLoader(graph, seeds, _Broken([3], 3), 20, device="cpu", num_workers=2))
    got = [next(it) for _ in range(3)]  # batches 0, 1, 2 come first, in order
    assert len(got) == 3
    with pytest.raises(RuntimeError, match="exploded at batch 3"):
        next(it)


def test_bad_configuration() -> None:
    graph, feats, labels, seeds = _data(seed=5)
    with pytest.raises(LoaderError, match="duplicates"):
        NeighborLoader(graph, torch.tensor([1, 2, 1]), [2], device="cpu")
    with pytest.raises(LoaderError, match="seed ids"):
        NeighborLoader(graph, torch.tensor([1, 5000]), [2], device="cpu")
    with pytest.raises(LoaderError, match="rows"):
        NeighborLoader(graph, seeds, [2], features=feats[:10], device="cpu")
    with pytest.raises(LoaderError, match="batch_size"):
        NeighborLoader(graph, seeds, [2], batch_size=0, device="cpu")
    with pytest.raises(LoaderError, match="gather_stream must be 'sample', 'own' or 'serial', got 'fast'"):
        NeighborLoader(graph, seeds, [2], device="cpu", gather_stream="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("gather_stream", ["sample", "own", "serial"])
@pytest.mark.parametrize("workers", [1, 2])
def test_gpu_every_gather_stream_gives_the_cpu_batches(cuda_device, gather_stream: str, workers: int) -> None:
    graph, feats, labels, seeds = _data(n=3000, e=50000, f=20, seed=13)
    mk = lambda g, f, l, dev, **kw: NeighborLoader(g, seeds, NeighborSampler([6, 3], seed=4), 200,  # noqa: E731
                                                   shuffle=True, features=f, labels=l, device=dev, **kw)
    ref = _collect(mk(graph, feats, labels, "cpu", prefetch=0))
    loader = mk(graph.to("unified"), to_placement(feats, "unified"), to_placement(labels, "unified"), "cuda",
                prefetch=2, num_workers=workers, gather_stream=gather_stream)
    assert loader.gather_stream == gather_stream
    for (s0, b0, x0, y0), (s1, b1, x1, y1) in zip(ref, _collect(loader), strict=True):
        assert torch.equal(s0, s1) and torch.equal(x0, x1) and torch.equal(y0, y1)
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(b0, b1))


@pytest.mark.gpu
@pytest.mark.parametrize("graph_on, feats_on", [("unified", "unified"), ("cuda", "cuda"), ("cpu", "cpu"),
                                                ("unified", "cpu"), ("cpu", "unified")])
@pytest.mark.parametrize("prefetch, workers", [(0, 1), (2, 1), (1, 3)])
def test_gpu_batches_equal_cpu_batches(cuda_device, graph_on, feats_on, prefetch, workers) -> None:

    graph, feats, labels, seeds = _data(n=4000, e=80000, f=37, seed=6)
    mk = lambda g, f, l, dev, p, w: NeighborLoader(g, seeds, NeighborSampler([7, 4, 2], seed=3), 256,  # noqa: E731
                                                   shuffle=True, features=f, labels=l, device=dev, prefetch=p,
                                                   num_workers=w)
    ref = _collect(mk(graph, feats, labels, "cpu", 0, 1))
    loader = mk(graph.to(graph_on), to_placement(feats, feats_on), to_placement(labels, feats_on), "cuda",
                prefetch, workers)
    assert loader.sample_device.type == ("cuda" if graph_on != "cpu" else "cpu")
    got = []
    for b in loader:
        assert b.x.device.type == "cuda" and b.y.device.type == "cuda"
        assert all(blk.device.type == "cuda" for blk in b.blocks)
        # the consumer's stream uses the batch right away: the event + record_stream make this safe
        got.append((b.seeds.cpu(), [(blk.src_nodes.cpu(), blk.indices.cpu()) for blk in b.blocks],
                    (b.x * 1).cpu(), b.y.cpu()))
    for (s0, b0, x0, y0), (s1, b1, x1, y1) in zip(ref, got, strict=True):
        assert torch.equal(s0, s1) and torch.equal(x0, x1) and torch.equal(y0, y1)
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(b0, b1))


@pytest.mark.gpu
def test_gpu_prefetch_gathers_on_its_own_stream_and_prepare_can_wait_for_it(cuda_device) -> None:

    graph, feats, labels, seeds = _data(n=6000, e=120000, f=64, seed=11)
    sums = []

    def prepare(batch):
        assert batch.x is not None and batch.x.dtype == torch.float32  # shape/dtype known before the gather ends
        batch.wait_for_inputs()
        s = batch.x.sum(1)
        sums.append(s)
        return [s]

    loader = NeighborLoader(graph.to("unified"), seeds, NeighborSampler([8, 4], seed=2), 300, shuffle=True,
                            features=to_placement(feats, "unified"), labels=to_placement(labels, "unified"),
                            device="cuda", prefetch=2, prepare=prepare)
    for i, b in enumerate(loader):
        want = feats[b.input_nodes.cpu()]
        assert torch.equal(b.x.cpu(), want)
        assert torch.equal(b.y.cpu(), labels[b.seeds.cpu()])
        torch.testing.assert_close(sums[i].cpu(), want.sum(1))
    assert len(sums) == len(loader)


@pytest.mark.gpu
def test_gpu_prefetch_reports_an_out_of_range_gather(cuda_device) -> None:

    graph, feats, labels, seeds = _data(n=3000, e=60000, f=16, seed=12)
    loader = NeighborLoader(graph.to("unified"), seeds, NeighborSampler([5, 5], seed=1), 256,
                            features=to_placement(feats, "unified"), labels=to_placement(labels, "unified"),
                            device="cuda", prefetch=1)
    # tables shorter than the graph (bypassing the constructor's check): the kernels see ids >= their rows
    loader.features = to_placement(feats[:1000].contiguous(), "unified")
    loader.labels = to_placement(labels[:1000].contiguous(), "unified")
    with pytest.raises(LoaderError, match="out-of-range node id .*size 1000"):
        for _ in loader:
            pass


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [1, 2])
def test_gpu_pipelined_producer_hands_over_batches_before_an_error(cuda_device, workers) -> None:
    graph, feats, labels, seeds = _data(seed=13)
    it = iter(NeighborLoader(graph.to("unified"), seeds, _Broken([3, 2], 3), 20, features=feats.pin_memory(),
                             labels=labels.pin_memory(), device="cuda", num_workers=workers))
    got = [next(it) for _ in range(3)]  # batches 0, 1, 2 come first, in order, with their features
    for b in got:
        assert torch.equal(b.x.cpu(), feats[b.input_nodes.cpu()])
    with pytest.raises(RuntimeError, match="exploded at batch 3"):
        next(it)
