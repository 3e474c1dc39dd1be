"""Every CUDA aggregation kernel against the float64 reference: each dtype, variant and width, forward and backward.

Plans force the kernel (rows, groups, tensor_core, cusparse) in both directions (the gradient
runs the same kernel over the transposed CSR).  Also: the row split's long-row pieces, tf32,
the probe, the fused path over every table form, empty inputs, and the checked-once rule.
"""
from __future__ import annotations

import pytest
import torch

from datapath.graph import CSRGraph
from datapath.ops import KERNELS, aggregate, as_csr, cached_keys, plan_aggregation
from datapath.ops.tolerance import Tolerance, assert_close, tolerance
from datapath.testing import power_law_csr, reference_aggregate

pytestmark = pytest.mark.gpu

VARIANTS = ("sum", "mean", "gcn_weighted")


def _graph(seed: int, index_dtype: torch.dtype, trusted: bool = False, num_edges: int = 2500) -> CSRGraph:
    g = power_law_csr(300, 260, num_edges, seed=seed, index_dtype=index_dtype, device="cuda")
    return CSRGraph(g.indptr, g.indices, g.num_src_nodes, g.num_dst_nodes, trusted=trusted)


def _row_len(g: CSRGraph) -> int:
    """The longest row of ``g`` or of its transpose (the gradient's): the most terms behind one result element."""
    ip = g.indptr.cpu()
    longest = int((ip[1:] - ip[:-1]).max()) if g.num_dst_nodes else 0
    return max(longest, int(torch.bincount(g.indices.cpu().long(), minlength=1).max()))


def _tol(g: CSRGraph, dtype: torch.dtype, kernel: str | None = None) -> Tolerance:
    """`datapath.ops.tolerance` for ``kernel`` on ``g``'s rows (forward and gradient)."""
    return tolerance(dtype, _row_len(g), kernel)


def _check(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance, what: str) -> None:
    assert_close(got, ref, tol, what)


def _run(g: CSRGraph, kernel: str, dtype: torch.dtype, variant: str, width: int, **plan_kw) -> None:
    torch.manual_seed(width)
    x = torch.randn(g.num_src_nodes, width, device="cuda").to(dtype).requires_grad_()
    w = (torch.rand(g.indices.numel(), device="cuda") + 0.25).requires_grad_() if variant == "gcn_weighted" else None
    reduce = "mean" if variant == "mean" else "sum"
    norm = "gcn" if variant == "gcn_weighted" else None
    plan = plan_aggregation(g, width, dtype, kernel=kernel, **plan_kw)
    out = aggregate(g, x, reduce, edge_weight=w, norm=norm, plan=plan)
    assert out.dtype == dtype and out.shape == (g.num_dst_nodes, width)
    gy = torch.randn(out.shape, device="cuda").to(dtype)
    out.backward(gy)
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_() if w is not None else None
    ref = reference_aggregate(g, x64, reduce, w64, norm)
    ref.backward(gy.double().cpu())
    what = f"{kernel} {dtype} {variant} F={width}"
    tol = _tol(g, dtype, kernel)
    _check(out, ref, tol, what + " forward")
    _check(x.grad, x64.grad, tol, what + " grad x")
    if w is not None:  # an SDDMM of width F in x's dtype, cast to w's (float32): rounded to the coarser of the two
        coarser = max((dtype, w.dtype), key=lambda d: torch.finfo(d).eps)
        _check(w.grad, w64.grad, tolerance(coarser, width + _row_len(g)), what + " grad w")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("width", [3, 16, 64, 602])
def test_every_kernel_matches_the_reference(kernel: str, dtype: torch.dtype, variant: str, width: int) -> None:
    if kernel == "tensor_core" and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("the tensor-core kernel takes float16/bfloat16 (float32 only as tf32, tested below)")
    idx = torch.int32 if width % 2 else torch.int64
    g = _graph(width + len(variant), idx)
    _run(g, kernel, dtype, variant, width)  # tolerance by kernel: cuSPARSE sums half rows in their own precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("cut", [1, 8])
def test_row_split_long_rows(dtype: torch.dtype, trusted: bool, cut: int) -> None:
    """Rows longer than ``cut`` go to the atomic tail pieces; a trusted graph's degrees are unknown."""
    g = power_law_csr(200, 180, 6000, alpha=2.0, seed=3, device="cuda")  # a few rows of hundreds of edges
    g = CSRGraph(g.indptr, g.indices, g.num_src_nodes, g.num_dst_nodes, trusted=trusted)
    _run(g, "rows", dtype, "gcn_weighted", 40, cut=cut)
    _run(g, "rows", dtype, "mean", 128, cut=cut, cf=2)
    _run(g, "rows", dtype, "sum", 602, cut=cut, cf=4)
    _run(g, "rows", dtype, "mean", 64, cut=cut, vec=2, dw=32)  # one row per warp
    _run(g, "rows", dtype, "gcn_weighted", 64, cut=cut, row_order="degree")  # rows by length
    _run(g, "rows", dtype, "sum", 602, cut=cut, cf=4, row_order="degree", sweep="columns")
    _run(g, "rows", dtype, "gcn_weighted", 130, cut=cut, sweep="columns")  # a part-filled last chunk


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_long_rows_fill_every_float32_slot(dtype: torch.dtype) -> None:
    """16-bit rows with a tail keep only the long rows' sums in float32, in at most num_edges // (cut + 1) slots:
    here every slot is used (each long row has exactly cut + 1 edges), between rows without edges and short rows."""
    gen = torch.Generator().manual_seed(9)
    deg = torch.tensor([9] * 50 + [0] * 12 + [1] * 8)[torch.randperm(70, generator=gen)]  # 458 edges: 50 slots
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
    indices = torch.randint(0, 90, (int(indptr[-1]),), generator=gen)
    g = CSRGraph(indptr.cuda(), indices.cuda(), 90, 70)
    for variant, width in (("sum", 64), ("gcn_weighted", 6), ("mean", 602)):
        _run(g, "rows", dtype, variant, width, cut=8)
    short = CSRGraph(indptr.cuda(), indices.cuda(), 90, 70)  # the same rows, none long at the default cut
    _run(short, "rows", dtype, "sum", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_row_buffers_are_reused_across_calls_and_streams(dtype: torch.dtype) -> None:
    """The long rows' sums pass through a buffer (and counters) kept per stream that every launch leaves zero:
    repeated calls on one graph, on the default stream and on more side streams than buffers are kept for (the
    oldest freed), each match the reference."""
    g = power_law_csr(200, 180, 6000, alpha=2.0, seed=5, device="cuda")
    plan = plan_aggregation(g, 64, dtype, kernel="rows", cut=8)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(g.num_src_nodes, 64, generator=gen).to(dtype).cuda() for _ in range(4)]
    refs = [reference_aggregate(g, x.double().cpu(), "sum") for x in xs]
    sides = [torch.cuda.Stream() for _ in range(11)]
    for s in sides:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for k in range(36):
        i = k % len(xs)
        if k % 3 == 0:
            outs.append((k, i, aggregate(g, xs[i], plan=plan)))
        else:
            with torch.cuda.stream(sides[k % len(sides)]):
                outs.append((k, i, aggregate(g, xs[i], plan=plan)))
    torch.cuda.synchronize()
    for k, i, out in outs:
        _check(out, refs[i], _tol(g, dtype, "rows"), f"call {k} ({'default' if k % 3 == 0 else 'side'} stream)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("rows_per_team", [2, 8, 32])
def test_several_rows_per_team(dtype: torch.dtype, rows_per_team: int) -> None:
    """A team walking several rows' edges as one run: rows without edges (first, last, runs of them across
    team boundaries) come out zero, long rows are summed whole, every variant and a part-filled column chunk."""
    gen = torch.Generator().manual_seed(rows_per_team)
    deg = torch.randint(0, 4, (700,), generator=gen) * (torch.rand(700, generator=gen) < 0.6)
    deg[:5] = 0
    deg[-7:] = 0
    deg[100:180] = 0  # empty rows spanning several teams
    deg[300] = 900  # one long row
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
    indices = torch.randint(0, 500, (int(indptr[-1]),), generator=gen)
    g = CSRGraph(indptr.cuda(), indices.cuda(), 500, 700)
    for variant, width, kw in (("sum", 3, {}), ("gcn_weighted", 64, {}), ("mean", 130, {"sweep": "columns"}),
                               ("sum", 602, {"cf": 4})):
        _run(g, "rows", dtype, variant, width, rows_per_team=rows_per_team, **kw)
    with pytest.raises(ValueError, match="row_order"):
        plan_aggregation(g, 64, dtype, kernel="rows", rows_per_team=4, row_order="degree")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_blocks_plan_several_rows_per_team(dtype: torch.dtype) -> None:
    """A sampled block's fanout bounds its rows: the model plans several short rows per team for the input layer
    (no probe, no host sync) and the result and gradient match the reference."""
    from datapath.graph import Graph
    from datapath.sampling import NeighborSampler

    gen = torch.Generator().manual_seed(3)
    src, dst = torch.randint(0, 40_000, (2, 400_000), generator=gen)
    graph = Graph.from_edge_index(torch.stack([src, dst]), 40_000).to("cuda")
    blocks = NeighborSampler([10, 4]).sample(graph, torch.randperm(40_000, device="cuda")[:300])
    first = blocks[0]  # the input layer: fanout 4
    assert first.max_degree == 4
    plan = plan_aggregation(first, 128, dtype)
    assert plan.kernel == "rows" and plan.rows_per_team > 1
    # the gradient's CSR: about one edge per source row (12K edges from 11K sources), its longest unknown
    view_t = as_csr(first).transposed()
    assert view_t.max_degree is None and view_t.num_edges <= 1.5 * view_t.num_dst
    assert plan_aggregation(view_t, 128, dtype).rows_per_team > 1
    for b in blocks:
        x = torch.randn(b.num_src_nodes, 128, device="cuda").to(dtype).requires_grad_()
        out = aggregate(b, x, "mean")
        gy = torch.randn(out.shape, device="cuda").to(dtype)
        out.backward(gy)
        x64 = x.detach().double().cpu().requires_grad_()
        ref = reference_aggregate(b.to("cpu"), x64, "mean")
        ref.backward(gy.double().cpu())
        _check(out, ref, _tol(b, dtype), f"block {b.max_degree} forward")
        _check(x.grad, x64.grad, _tol(b, dtype), f"block {b.max_degree} grad x")


def test_tensor_core_tf32() -> None:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for variant in VARIANTS:
            _run(_graph(7, torch.int32), "tensor_core", torch.float32, variant, 48)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    with pytest.raises(ValueError, match="tensor-core"):  # tf32 is opt-in, as for matmuls
        aggregate(_graph(7, torch.int32), torch.randn(260, 8, device="cuda"),
                  plan=plan_aggregation(_graph(7, torch.int32), 8, kernel="tensor_core"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_chooses_once_and_the_choice_is_kept(dtype: torch.dtype) -> None:
    g = power_law_csr(20_000, 20_000, 200_000, seed=1, index_dtype=torch.int32, device="cuda")
    plan = plan_aggregation(g, 64, dtype, "mean", probe=True)
    assert plan.kernel in KERNELS and plan.probed_ms is not None and plan.probed_ms > 0
    assert any(isinstance(k, tuple) and k[0] == "plan" for k in cached_keys(g))
    x = torch.randn(g.num_src_nodes, 64, device="cuda").to(dtype).requires_grad_()
    out = aggregate(g, x, "mean")
    out.backward(torch.randn_like(out))
    ref = reference_aggregate(g, x.detach().double().cpu(), "mean")
    _check(out, ref, _tol(g, dtype, plan.kernel), f"probed {plan.kernel}")


KEPT_CASES = [(k, dt, a) for k in ("groups", "rows", "cusparse") for dt in (torch.float32, torch.float16)
              for a in (0.0, 2.0) if not (k == "cusparse" and dt == torch.float16 and a == 2.0)]
"""(cuSPARSE accumulates float16 in float16: on long rows only by request; see the test after this one)"""


@pytest.mark.parametrize(("kernel", "dtype", "alpha"), KEPT_CASES)
def test_kept_plan_of_each_kernel_matches_the_reference(kernel: str, dtype: torch.dtype, alpha: float) -> None:
    """A graph's kept plan (probed among one kernel) runs through its bound launch, forward and gradient, with
    short rows only (alpha 0: at most 5 edges, each row one neighbor group, nothing to zero) and with long rows
    (several groups per row, added atomically)."""
    g = power_law_csr(20_000, 20_000, 60_000 if alpha == 0.0 else 200_000, alpha=alpha, seed=4,
                      index_dtype=torch.int32, device="cuda")
    plan = plan_aggregation(g, 16, dtype, "mean", probe=True, kernels=(kernel,))
    assert plan.kernel == kernel
    for _ in range(2):  # the second call reuses the bound launch
        x = torch.randn(g.num_src_nodes, 16, device="cuda").to(dtype).requires_grad_()
        out = aggregate(g, x, "mean")
        gy = torch.randn(out.shape, device="cuda").to(dtype)
        out.backward(gy)
        x64 = x.detach().double().cpu().requires_grad_()
        ref = reference_aggregate(g, x64, "mean")
        ref.backward(gy.double().cpu())
        _check(out, ref, _tol(g, dtype, kernel), f"kept {kernel} forward")
        _check(x.grad, x64.grad, _tol(g, dtype, kernel), f"kept {kernel} grad x")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_probe_keeps_float32_accumulation_on_long_rows(dtype: torch.dtype) -> None:
    """In half precision on a graph with rows of thousands of edges the probe never keeps cuSPARSE (it
    accumulates in the operands' precision: several times our error there), so the result stays within the
    float32-accumulation tolerance; a caller who names cuSPARSE still gets it."""
    g = power_law_csr(4_000, 20_000, 400_000, alpha=2.0, seed=6, index_dtype=torch.int32, device="cuda")
    assert int((g.indptr[1:] - g.indptr[:-1]).max()) > 4096
    plan = plan_aggregation(g, 64, dtype, "mean", probe=True)  # a mean: no row sum overflows float16
    assert plan.kernel != "cusparse"
    x = torch.randn(g.num_src_nodes, 64, device="cuda").to(dtype)
    ref = reference_aggregate(g, x.double().cpu(), "mean")
    _check(aggregate(g, x, "mean"), ref, _tol(g, dtype), f"probed {plan.kernel}")
    assert plan_aggregation(g, 64, dtype, "mean", probe=True, kernels=("cusparse",)).kernel == "cusparse"


def test_untrusted_graph_is_checked_and_tuned_once_then_never_waits() -> None:
    g = power_law_csr(30_000, 30_000, 300_000, seed=2, index_dtype=torch.int32, device="cuda")
    x = torch.randn(g.num_src_nodes, 32, device="cuda", requires_grad=True)
    aggregate(g, x, "mean").sum().backward()  # checks the graph, probes forward and backward kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            out = aggregate(g, x, "mean")
            out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _tables(table: torch.Tensor) -> dict[str, torch.Tensor]:
    from datapath.unified_tensor import as_unified

    return {"cuda": table.cuda(), "pinned": table.clone().pin_memory(), "as_unified": as_unified(table.clone()),
            "to_unified": table.clone().to("unified")}


@pytest.mark.parametrize("form", ["cuda", "pinned", "as_unified", "to_unified"])
def test_fused_aggregation_over_every_table_form(form: str) -> None:
    """Issue 16's crash: a unified table read inside the fused aggregation (push and pull)."""
    g = _graph(11, torch.int32)
    torch.manual_seed(5)
    host = torch.randn(1000, 100)
    table = _tables(host)[form]
    ids = torch.randperm(1000)[: g.num_src_nodes].cuda()
    x = host.cuda()[ids]
    w = torch.rand(g.indices.numel(), device="cuda")
    for reduce in ("sum", "mean", "max"):
        want = aggregate(g, x, reduce)
        for fused in ("auto", "push", "pull"):
            got = aggregate(g, table, reduce, src_ids=ids, plan=plan_aggregation(g, 100, fused=fused))
            _check(got, want.double().cpu(), Tolerance(0.0, 1e-5), f"{form} {reduce} {fused}")
    got = aggregate(g, table, "sum", edge_weight=w, norm="gcn", src_ids=ids)
    _check(got, aggregate(g, x, "sum", w, "gcn").double().cpu(), Tolerance(0.0, 1e-5), f"{form} gcn weighted")
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernel", KERNELS)
def test_empty_inputs_give_empty_results(kernel: str) -> None:
    dt = torch.float16
    for nd, ns, f in ((0, 5, 8), (6, 5, 0), (6, 0, 8), (6, 5, 8)):
        g = CSRGraph(torch.zeros(nd + 1, dtype=torch.int64, device="cuda"),
                     torch.empty(0, dtype=torch.int32, device="cuda"), ns, nd)
        x = torch.randn(ns, f, device="cuda").to(dt).requires_grad_()
        plan = plan_aggregation(g, max(f, 1), dt, kernel=kernel) if f else None
        for reduce in ("sum", "mean", "max"):
            out = aggregate(g, x, reduce, plan=plan if reduce != "max" else None)
            assert out.shape == (nd, f) and bool((out == 0).all())
            out.sum().backward()
            assert x.grad.shape == x.shape and bool((x.grad == 0).all())
            x.grad = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_cusparse_takes_graphs_with_more_edges_than_matrix_entries(dtype: torch.dtype) -> None:
    """Duplicate edges in a small graph give more stored values than rows x columns, which cuSPARSE refuses
    (cusparseCreateCsr: invalid value): the library's matrix merges them (their sum), forward and gradient."""
    gen = torch.Generator().manual_seed(12)
    for nd, ns, e in ((1, 1, 3), (2, 3, 50), (7, 2, 400)):
        dst = torch.sort(torch.randint(0, nd, (e,), generator=gen)).values
        indptr = torch.zeros(nd + 1, dtype=torch.int64)
        indptr[1:] = torch.bincount(dst, minlength=nd).cumsum(0)
        g = CSRGraph(indptr.cuda(), torch.randint(0, ns, (e,), generator=gen).cuda(), ns, nd)
        for variant in VARIANTS:
            _run(g, "cusparse", dtype, variant, 5)
