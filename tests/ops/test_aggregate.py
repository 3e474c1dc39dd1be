"""datapath.ops.aggregate against a float64 dense/loop reference, on CPU and GPU."""
from __future__ import annotations

import pytest
import torch

from datapath.graph import CSRGraph
from datapath.ops import (
    DeviceMismatchError,
    FeatureShapeError,
    GraphFormatError,
    GraphIndexError,
    UnsupportedDtypeError,
    aggregate,
    cached_keys,
    plan_aggregation,
)
from datapath.ops.tolerance import assert_close as check_close
from datapath.ops.tolerance import tolerance
from datapath.testing import power_law_csr
from datapath.testing import reference_aggregate as ref_aggregate

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROW_LEN = 3000
"""A bound on the rows (and transposed rows) of this module's graphs (none has more edges), for
`datapath.ops.tolerance`."""


def make_graph(device: str, num_dst: int = 120, num_src: int = 150, num_edges: int = 900, seed: int = 0,
               index_dtype: torch.dtype = torch.int64) -> CSRGraph:
    return power_law_csr(num_dst, num_src, num_edges, seed=seed, index_dtype=index_dtype, device=device)


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Within `datapath.ops.tolerance` of the float64 reference (our kernels: float32 accumulation)."""
    check_close(got, ref, tolerance(dtype, ROW_LEN))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("width", [1, 3, 16, 37, 128, 602])
def test_forward_backward_fp32(device: str, reduce: str, width: int) -> None:
    g = make_graph(device, seed=width)
    torch.manual_seed(width)
    x = torch.randn(g.num_src_nodes, width, device=device, requires_grad=True)
    out = aggregate(g, x, reduce)
    gy = torch.randn_like(out)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = ref_aggregate(g, x64, reduce)
    ref.backward(gy.cpu().double())
    assert out.shape == (g.num_dst_nodes, width) and out.dtype == torch.float32 and out.device == x.device
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("width", [5, 64])
def test_edge_weight_forward_backward(device: str, reduce: str, width: int) -> None:
    g = make_graph(device, seed=3 + width)
    e = g.indices.numel()
    torch.manual_seed(1)
    x = torch.randn(g.num_src_nodes, width, device=device, requires_grad=True)
    w = (torch.rand(e, device=device) + 0.1).requires_grad_()
    out = aggregate(g, x, reduce, edge_weight=w)
    gy = torch.randn_like(out)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    ref = ref_aggregate(g, x64, reduce, w64)
    ref.backward(gy.cpu().double())
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
    assert_close(w.grad, w64.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 20, 602])
def test_gcn_norm(device: str, width: int) -> None:
    g = make_graph(device, seed=11)
    torch.manual_seed(2)
    x = torch.randn(g.num_src_nodes, width, device=device, requires_grad=True)
    w = (torch.rand(g.indices.numel(), device=device) + 0.5).requires_grad_()
    out = aggregate(g, x, norm="gcn", edge_weight=w)
    gy = torch.randn_like(out)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    ref = ref_aggregate(g, x64, "sum", w64, norm="gcn")
    ref.backward(gy.cpu().double())
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
    assert_close(w.grad, w64.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("width", [8, 37, 256])
def test_low_precision_accumulates_in_fp32(device: str, dtype: torch.dtype, reduce: str, width: int) -> None:
    g = make_graph(device, num_edges=1500, seed=5)
    torch.manual_seed(3)
    x = torch.randn(g.num_src_nodes, width, device=device).to(dtype).requires_grad_()
    out = aggregate(g, x, reduce)
    assert out.dtype == dtype
    gy = torch.randn(out.shape, device=device).to(dtype)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = ref_aggregate(g, x64, reduce)
    ref.backward(gy.cpu().double())
    assert_close(out, ref, dtype)
    assert x.grad.dtype == dtype
    assert_close(x.grad, x64.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_head_edge_weight(device: str) -> None:
    g = make_graph(device, seed=7)
    heads, d = 4, 6
    torch.manual_seed(4)
    x = torch.randn(g.num_src_nodes, heads, d, device=device, requires_grad=True)
    w = torch.rand(g.indices.numel(), heads, device=device, requires_grad=True)
    out = aggregate(g, x, "sum", edge_weight=w)
    assert out.shape == (g.num_dst_nodes, heads, d)
    gy = torch.randn_like(out)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    ref = torch.stack([ref_aggregate(g, x64[:, h], "sum", w64[:, h]) for h in range(heads)], 1)
    ref.backward(gy.cpu().double())
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
    assert_close(w.grad, w64.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_indices_and_tuple_graph(device: str) -> None:
    g = make_graph(device, index_dtype=torch.int32, seed=9)
    x = torch.randn(g.num_src_nodes, 12, device=device)
    tup = (g.indptr.to(torch.int32), g.indices, g.num_src_nodes)
    ref = ref_aggregate(g, x.cpu().double(), "mean")
    assert_close(aggregate(g, x, "mean"), ref, torch.float32)
    assert_close(aggregate(tup, x, "mean"), ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_graph_and_all_isolated(device: str) -> None:
    g = CSRGraph(torch.zeros(6, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int64, device=device),
                 4, 5)
    x = torch.randn(4, 7, device=device, requires_grad=True)
    for reduce in ("sum", "mean", "max"):
        out = aggregate(g, x, reduce)
        assert out.shape == (5, 7) and bool((out == 0).all())
        out.sum().backward()
        assert bool((x.grad == 0).all())
        x.grad = None


@pytest.mark.parametrize("device", DEVICES)
def test_fused_src_ids_matches_gather_then_aggregate(device: str) -> None:
    g = make_graph(device, seed=13)
    torch.manual_seed(5)
    table = torch.randn(1000, 100)
    if device == "cuda":
        table = table.pin_memory()
    ids = torch.randperm(1000)[: g.num_src_nodes].to(device)
    for reduce in ("sum", "mean", "max"):
        want = aggregate(g, table.to(device)[ids], reduce)
        for fused in ("auto", "push", "pull"):
            plan = plan_aggregation(g, 100, fused=fused)
            got = aggregate(g, table, reduce, src_ids=ids, plan=plan)
            assert_close(got, want.double().cpu(), torch.float32)
    w = torch.rand(g.indices.numel(), device=device)
    got = aggregate(g, table, "sum", edge_weight=w, norm="gcn", src_ids=ids)
    assert_close(got, aggregate(g, table.to(device)[ids], "sum", w, "gcn").double().cpu(), torch.float32)


def test_fused_src_ids_rejects_grad_and_bad_ids() -> None:
    g = make_graph("cpu")
    table = torch.randn(500, 8, requires_grad=True)
    ids = torch.randperm(500)[: g.num_src_nodes]
    with pytest.raises(FeatureShapeError, match="gradient"):
        aggregate(g, table, src_ids=ids)
    bad = ids.clone()
    bad[3] = 500
    with pytest.raises(GraphIndexError, match="500"):
        aggregate(g, table.detach(), src_ids=bad)
    with pytest.raises(FeatureShapeError, match="shape"):
        aggregate(g, table.detach(), src_ids=ids[:-1])


def test_input_validation() -> None:
    g = make_graph("cpu")
    x = torch.randn(g.num_src_nodes, 4)
    with pytest.raises(FeatureShapeError, match="source nodes"):
        aggregate(g, x[:-1])
    with pytest.raises(UnsupportedDtypeError):
        aggregate(g, x.long())
    with pytest.raises(ValueError, match="reduce"):
        aggregate(g, x, "median")
    with pytest.raises(ValueError, match="gcn"):
        aggregate(g, x, "max", norm="gcn")
    with pytest.raises(FeatureShapeError, match="edges"):
        aggregate(g, x, edge_weight=torch.rand(3))
    bad = CSRGraph(g.indptr, g.indices.clone(), g.num_src_nodes, g.num_dst_nodes)
    bad.indices[5] = g.num_src_nodes
    with pytest.raises(GraphIndexError, match="num_src_nodes"):
        aggregate(bad, x)
    with pytest.raises(GraphFormatError, match="num_dst_nodes"):
        aggregate(CSRGraph(g.indptr[:-1], g.indices, g.num_src_nodes, g.num_dst_nodes), x)
    with pytest.raises(GraphFormatError, match="start at 0"):
        aggregate((g.indptr + 1, g.indices, g.num_src_nodes), x)
    dec = g.indptr.clone()
    dec[3] = int(dec[5]) + 1  # row 3 gets a negative length
    with pytest.raises(GraphFormatError):
        aggregate((dec, g.indices, g.num_src_nodes), x)
    with pytest.raises(GraphFormatError, match="tuple"):
        aggregate((g.indptr, g.indices), x)
    with pytest.raises(GraphFormatError, match="indptr"):
        aggregate(object(), x)
    with pytest.raises(FeatureShapeError, match="heads"):
        aggregate(g, x, edge_weight=torch.rand(g.indices.numel(), 3))


def test_cache_is_kept_beside_the_graph_and_invalidated() -> None:
    import gc
    import weakref

    g = make_graph("cpu")
    attrs = set(vars(g))
    x = torch.randn(g.num_src_nodes, 4, requires_grad=True)
    aggregate(g, x, "mean").sum().backward()
    assert set(vars(g)) == attrs  # nothing set on the caller's object
    keys = cached_keys(g)
    assert "edge_dst" in keys and ("row_scale", "mean", torch.float32) in keys
    g.indices[0] = (g.indices[0] + 1) % g.num_src_nodes  # in-place change: the cache must drop
    out = aggregate(g, x.detach(), "sum", norm="gcn")  # gcn uses the (changed) source degrees
    assert ("row_scale", "mean", torch.float32) not in cached_keys(g)
    assert_close(out, ref_aggregate(g, x.detach().double(), "sum", norm="gcn"), torch.float32)
    ref = weakref.ref(g)
    del g, out
    gc.collect()
    assert ref() is None  # the cache does not keep the graph alive


def test_tuple_graph_is_checked_every_call_and_object_once() -> None:
    g = make_graph("cpu")
    x = torch.randn(g.num_src_nodes, 3)
    bad = g.indices.clone()
    bad[0] = g.num_src_nodes
    with pytest.raises(GraphIndexError):
        aggregate((g.indptr, bad, g.num_src_nodes), x)
    aggregate(g, x)
    assert cached_keys(g)  # the object's check is kept


@pytest.mark.gpu
def test_device_mismatch_is_reported(cuda_device: torch.device) -> None:
    g = make_graph("cpu")
    with pytest.raises(DeviceMismatchError, match="move"):
        aggregate(g, torch.randn(g.num_src_nodes, 4, device=cuda_device))


def test_plan_model_and_overrides() -> None:
    g = make_graph("cpu")
    p16 = plan_aggregation(g, 16)
    assert (p16.vec, p16.dw, p16.passes) == (4, 4, 1)
    p602 = plan_aggregation(g, 602)
    assert p602.vec == 2 and p602.dw == 32 and p602.passes == 10
    assert p602.work_per_thread == p602.ngs * p602.passes
    ph = plan_aggregation(g, 128, torch.bfloat16)
    assert ph.vec == 8 and ph.dw == 16
    p = p16.replace(ngs=3, backward="atomic")
    assert p.ngs == 3 and p.backward == "atomic" and p.work_per_thread == 3
    with pytest.raises(ValueError, match="dw"):
        p16.replace(dw=3)
    with pytest.raises(ValueError, match="vec"):
        plan_aggregation(g, 6, vec=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("override", [
    {"ngs": 1}, {"ngs": 3, "threads_per_block": 32}, {"ngs": 32, "threads_per_block": 256},
    {"dw": 8}, {"backward": "atomic"}, {"backward": "atomic", "ngs": 2},
])
@pytest.mark.parametrize("width", [4, 50, 130])
def test_plan_overrides_give_the_same_result(device: str, override: dict, width: int) -> None:
    g = make_graph(device, num_dst=200, num_edges=3000, seed=17)
    torch.manual_seed(6)
    x = torch.randn(g.num_src_nodes, width, device=device, requires_grad=True)
    w = torch.rand(g.indices.numel(), device=device, requires_grad=True)
    plan = plan_aggregation(g, width, **override)
    out = aggregate(g, x, "mean", edge_weight=w, plan=plan)
    gy = torch.randn_like(out)
    out.backward(gy)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    ref = ref_aggregate(g, x64, "mean", w64)
    ref.backward(gy.cpu().double())
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, x64.grad, torch.float32)
    assert_close(w.grad, w64.grad, torch.float32)


def test_trusted_graph_skips_only_the_value_check() -> None:
    from datapath.ops import GraphFormatError, GraphIndexError, as_csr

    class G:
        def __init__(self, trusted: bool, indptr: torch.Tensor) -> None:
            self.indptr, self.indices = indptr, torch.tensor([0, 5, 1])  # 5 is out of range for 3 sources
            self.num_src_nodes, self.num_dst_nodes, self.trusted = 3, 2, trusted

    good_ptr = torch.tensor([0, 2, 3])
    with pytest.raises(GraphIndexError):
        as_csr(G(False, good_ptr))
    view = as_csr(G(True, good_ptr))  # the caller vouches for the contents: no host sync, no range check
    assert view.num_src == 3 and view.indices.numel() == 3
    with pytest.raises(GraphFormatError):  # shapes are still checked
        as_csr(G(True, torch.tensor([0, 3])))


def test_sampled_blocks_are_trusted_and_correct() -> None:
    from datapath.graph import Graph
    from datapath.sampling import NeighborSampler

    g = torch.Generator().manual_seed(3)
    graph = Graph.from_edge_index(torch.randint(0, 500, (2, 4000), generator=g), 500)
    blocks = NeighborSampler([5, 3], seed=1).sample(graph, torch.arange(0, 500, 7))
    for b in blocks:
        assert b.trusted
        assert int(b.indices.max()) < b.num_src_nodes and int(b.indices.min()) >= 0
        x = torch.randn(b.num_src_nodes, 6, dtype=torch.float64)
        ref = torch.zeros(b.num_dst_nodes, 6, dtype=torch.float64)
        dst = torch.repeat_interleave(torch.arange(b.num_dst_nodes), b.in_degrees())
        ref.index_add_(0, dst, x[b.indices])
        torch.testing.assert_close(aggregate(b, x, reduce="sum"), ref)


def test_the_model_plans_several_rows_per_team_only_for_short_rows() -> None:
    """The CUDA plan the model makes (pure arithmetic, so checked here on the CPU): several rows per team on a
    block whose fanout bounds short rows and on its transposed CSR (about an edge per row, longest unknown); one
    row per team on the same block without the bound, and on a block of longer rows."""
    from datapath.graph import Graph
    from datapath.ops import as_csr
    from datapath.sampling import Block, NeighborSampler

    g = torch.Generator().manual_seed(5)
    graph = Graph.from_edge_index(torch.randint(0, 40_000, (2, 400_000), generator=g), 40_000)
    first, last = NeighborSampler([12, 4], seed=2).sample(graph, torch.arange(0, 40_000, 131))
    assert first.max_degree == 4 and last.max_degree == 12
    assert plan_aggregation(first, 64).rows_per_team > 1  # float32 F=64: a team of 16 lanes; rows <= 4 edges
    view_t = as_csr(first).transposed()
    assert view_t.max_degree is None and view_t.num_edges <= 1.5 * view_t.num_dst
    assert plan_aggregation(view_t, 64).rows_per_team == 8
    unbounded = Block(first.indptr, first.indices, first.src_nodes, first.num_dst_nodes, trusted=True)
    assert plan_aggregation(unbounded, 64).rows_per_team == 1  # ~4 edges a row: too many without a bound
    assert plan_aggregation(last, 64).rows_per_team == 1  # ~12 edges a row
    with pytest.raises(ValueError, match="row_order"):  # several rows a team walk them in stored order
        plan_aggregation(first, 64).replace(row_order="degree")


def test_bad_input_names_the_argument_before_any_kernel_runs() -> None:
    g = make_graph("cpu")
    x = torch.randn(g.num_src_nodes, 4)
    unsorted = g.indptr.clone()
    unsorted[10], unsorted[11] = g.indptr[11] + 3, g.indptr[10]
    cases = [
        ((g.indptr.float(), g.indices, g.num_src_nodes), GraphFormatError, "graph.indptr must be int32 or int64"),
        ((g.indptr, g.indices.float(), g.num_src_nodes), GraphFormatError, "graph.indices must be int32 or int64"),
        ((unsorted, g.indices, g.num_src_nodes), GraphFormatError, "graph.indptr must be non-decreasing"),
        ((g.indptr.clone().fill_(0), g.indices, g.num_src_nodes), GraphFormatError, "graph.indptr must start at 0"),
        ((g.indptr, g.indices.clone().fill_(-1), g.num_src_nodes), GraphIndexError, "graph.indices range"),
        ((g.indptr.view(1, -1), g.indices, g.num_src_nodes), GraphFormatError, "graph.indptr and graph.indices must be 1-D"),
    ]
    for graph, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            aggregate(graph, x)
    with pytest.raises(UnsupportedDtypeError, match="x has dtype torch.int64"):
        aggregate(g, x.long())
    with pytest.raises(ValueError, match="reduce must be one of"):
        aggregate(g, x, "min")
    with pytest.raises(ValueError, match="norm must be None or 'gcn'"):
        aggregate(g, x, norm="sym")
    with pytest.raises(UnsupportedDtypeError, match="edge_weight"):
        aggregate(g, x, edge_weight=torch.ones(g.indices.numel(), dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs_give_empty_results(device: str) -> None:
    """Issue 14: zero rows or zero width give an empty (or zero) result, and a zero gradient."""
    for nd, ns, f in ((0, 5, 8), (6, 5, 0), (6, 0, 8), (0, 0, 0)):
        g = CSRGraph(torch.zeros(nd + 1, dtype=torch.int64, device=device),
                     torch.empty(0, dtype=torch.int64, device=device), ns, nd)
        for shape in ((ns, f), (ns, 2, f)):
            x = torch.randn(*shape, device=device, requires_grad=True)
            for reduce in ("sum", "mean", "max"):
                out = aggregate(g, x, reduce)
                assert out.shape == (nd, *shape[1:]) and bool((out == 0).all())
                out.sum().backward()
                assert x.grad.shape == x.shape and bool((x.grad == 0).all())
                x.grad = None


def test_plan_api() -> None:
    from datapath.ops import KERNELS, AggregationPlan

    g = make_graph("cpu")
    p = plan_aggregation(g, 64, torch.bfloat16)
    assert isinstance(p, AggregationPlan) and p.kernel == "rows" and p.probed_ms is None
    assert p.vec == 8 and p.dw == 8 and p.chunks == 1
    for k in KERNELS:
        assert plan_aggregation(g, 64, kernel=k).kernel == k
    assert plan_aggregation(g, 602).chunks == 5  # vec 2, 32 lanes, two vectors per lane: 128 columns a team
    with pytest.raises(ValueError, match="kernel"):
        plan_aggregation(g, 64, kernel="magic")
    with pytest.raises(ValueError, match="unroll"):
        plan_aggregation(g, 64, unroll=3)
    assert plan_aggregation(g, 64, row_order="degree").row_order == "degree"
    with pytest.raises(ValueError, match="row_order"):
        plan_aggregation(g, 64, row_order="random")
    with pytest.raises(ValueError, match="sweep"):
        plan_aggregation(g, 64, sweep="diagonal")
    with pytest.raises(ValueError, match="rows_per_team"):
        plan_aggregation(g, 64, rows_per_team=0)
    with pytest.raises(ValueError, match="probe"):
        plan_aggregation(g, 64, probe=True)  # the probe times CUDA kernels; the graph is on the CPU
    x = torch.randn(g.num_src_nodes, 64)
    torch.testing.assert_close(aggregate(g, x, plan=p.replace(vec=4)), aggregate(g, x))  # ignored on the CPU


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_without_rows_or_sources_keep_every_gradient_and_take_empty_tables(device: str) -> None:
    """No destination rows: the (empty) result still depends on x and the edge weight (their gradients are zero,
    backward runs); no sources: an empty feature table (which cannot be pinned) is read through empty src_ids."""
    g = CSRGraph(torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device),
                 5, 0)
    x = torch.randn(5, 4, device=device, requires_grad=True)
    w = torch.rand(0, device=device, requires_grad=True)
    out = aggregate(g, x, "sum", edge_weight=w)
    assert out.shape == (0, 4) and out.requires_grad
    out.sum().backward()
    assert w.grad is not None and x.grad is not None and not x.grad.any()
    none = CSRGraph(torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device),
                    0, 2)
    for table in (torch.empty(0, 4), torch.empty(0, 4).to(device)):
        got = aggregate(none, table, "mean", src_ids=torch.zeros(0, dtype=torch.int64, device=device))
        assert got.shape == (2, 4) and not got.any()
