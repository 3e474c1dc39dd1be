"""datapath.ops.aggregate_transposed: the adjoint of aggregate, against autograd through aggregate and a dense
float64 reference; its bad input; a resolved runner outliving its graph."""
from __future__ import annotations

import gc

import pytest
import torch

from datapath.graph import CSRGraph
from datapath.ops import (
    KERNELS,
    FeatureShapeError,
    UnsupportedDtypeError,
    aggregate,
    aggregate_transposed,
    as_csr,
    plan_aggregation,
    transposed_aggregator,
)
from datapath.ops.tolerance import assert_close, tolerance
from datapath.testing import power_law_csr, reference_aggregate

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dense(g) -> torch.Tensor:  # noqa: ANN001
    ip = g.indptr.cpu()
    rows = torch.repeat_interleave(torch.arange(g.num_dst_nodes), ip[1:] - ip[:-1])
    a = torch.zeros(g.num_dst_nodes, g.num_src_nodes, dtype=torch.float64)
    a.index_put_((rows, g.indices.cpu().long()), torch.ones(rows.numel(), dtype=torch.float64), accumulate=True)
    return a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("reduce", "norm"), [("sum", None), ("mean", None), ("sum", "gcn")])
@pytest.mark.parametrize("size", [(90, 130, 700), (2500, 2500, 40_000)])  # the second: probed on CUDA
def test_is_the_gradient_of_aggregate(device: str, reduce: str, norm: str | None, size: tuple) -> None:
    if device == "cpu" and size[2] > 1000:
        pytest.skip("the large graph exercises the CUDA probe")
    g = power_law_csr(*size, seed=4, device=device)
    a = dense(g)
    if reduce == "mean":
        a = a / a.sum(1, keepdim=True).clamp(min=1)
    elif norm == "gcn":
        a = a / a.sum(1, keepdim=True).clamp(min=1).sqrt() / a.sum(0, keepdim=True).clamp(min=1).sqrt()
    y = torch.randn(g.num_dst_nodes, 24, device=device)
    got = aggregate_transposed(g, y, reduce, norm)
    assert got.shape == (g.num_src_nodes, 24) and got.dtype == y.dtype
    torch.testing.assert_close(got.cpu().double(), a.t() @ y.cpu().double(), rtol=1e-4, atol=1e-4)
    x = torch.randn(g.num_src_nodes, 24, device=device, requires_grad=True)
    aggregate(g, x, reduce, norm=norm).backward(y)
    # the same kernel, but long rows add their pieces atomically on the GPU (in any order): float32 rounding apart
    kw = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, x.grad, **kw)
    run = transposed_aggregator(g, 24, torch.float32, reduce, norm)  # resolved once, then only launched
    torch.testing.assert_close(run(y), got, **kw)
    torch.testing.assert_close(run(2 * y), 2 * got, **kw)


def test_bad_input() -> None:
    g = power_law_csr(20, 30, 80, seed=1)
    with pytest.raises(FeatureShapeError, match="num_dst_nodes"):
        aggregate_transposed(g, torch.randn(30, 4))
    with pytest.raises(ValueError, match="reduce"):
        aggregate_transposed(g, torch.randn(20, 4), "max")
    with pytest.raises(ValueError, match="norm"):
        aggregate_transposed(g, torch.randn(20, 4), "mean", "gcn")
    with pytest.raises(FeatureShapeError, match="no_grad"):
        aggregate_transposed(g, torch.randn(20, 4, requires_grad=True))
    with torch.no_grad():
        assert aggregate_transposed(g, torch.randn(20, 4, requires_grad=True)).shape == (30, 4)
    assert aggregate_transposed(g, torch.randn(20, 0)).shape == (30, 0)
    with pytest.raises(ValueError, match="feat"):
        transposed_aggregator(g, 0, torch.float32)
    with pytest.raises(UnsupportedDtypeError, match="dtype"):
        transposed_aggregator(g, 4, torch.int64)
    with pytest.raises(ValueError, match="reduce"):
        transposed_aggregator(g, 4, torch.float32, "max")
    with pytest.raises(ValueError, match="kernels"):
        plan_aggregation(g, 4, kernels=("rows",))  # without probe=True
    with pytest.raises(ValueError, match="kernels"):
        plan_aggregation(g, 4, kernels=("fastest",), probe=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_graphs_own_plan_runs_every_kernel_both_ways(kernel: str, dtype: torch.dtype) -> None:
    """Whichever kernel the probe keeps (here: the only one it may time), the calls that follow (their launches
    bound once) and the gradient over the transposed CSR match the reference."""
    if kernel == "tensor_core" and dtype == torch.float32:
        pytest.skip("float32 takes the tensor-core kernel only as tf32")
    g = power_law_csr(600, 700, 6000, seed=6, device="cuda")
    plan = plan_aggregation(g, 32, dtype, "mean", probe=True, kernels=(kernel,))
    assert plan.kernel == kernel
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for _ in range(2):  # the first call binds the launches, the second reuses them
        x = torch.randn(g.num_src_nodes, 32, device="cuda").to(dtype).requires_grad_()
        out = aggregate(g, x, "mean")
        y = torch.randn_like(out)
        out.backward(y)
        x64 = x.detach().double().cpu().requires_grad_()
        ref = reference_aggregate(g, x64, "mean")
        ref.backward(y.double().cpu())
        for got, want in ((out, ref), (x.grad, x64.grad), (aggregate_transposed(g, y, "mean"), x64.grad)):
            err = float((got.detach().double().cpu() - want.detach()).abs().max()) / max(1.0, float(want.abs().max()))
            assert err <= tol, f"{kernel} {dtype}: error {err:.3g}"


def _reuse_freed(freed: dict[int, int], device: str) -> tuple[list[torch.Tensor], int]:
    """Zero-filled allocations of the freed tensors' sizes until they land on the freed addresses (kept alive)."""
    keep: list[torch.Tensor] = []
    hits: set[int] = set()
    for _ in range(40):
        for n in sorted(set(freed.values())):
            keep.append(torch.zeros(max(1, n // 8), dtype=torch.int64, device=device))
            if keep[-1].data_ptr() in freed:
                hits.add(keep[-1].data_ptr())
        if len(hits) == len(freed):
            break
    return keep, len(hits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("reduce", "norm"), [("sum", None), ("mean", None), ("sum", "gcn")])
@pytest.mark.parametrize("shape", [(141, 850, 900), (300, 260, 2500)])  # a block's shape: short transposed rows
def test_transposed_aggregator_outlives_its_graph(device: str, reduce: str, norm: str | None, shape: tuple) -> None:
    """The runner is all a custom backward keeps: it must hold what its kernel reads.  The graph (and everything the
    ops derived from it) is dropped and its memory handed out again, zero-filled, before the runner is called."""
    g = power_law_csr(*shape, seed=5)
    a = dense(g)
    if reduce == "mean":
        a = a / a.sum(1, keepdim=True).clamp(min=1)
    elif norm == "gcn":
        a = a / a.sum(1, keepdim=True).clamp(min=1).sqrt() / a.sum(0, keepdim=True).clamp(min=1).sqrt()
    y = torch.randn(g.num_dst_nodes, 31)
    live = CSRGraph(g.indptr.to(device), g.indices.to(device), g.num_src_nodes, g.num_dst_nodes, trusted=True)
    run = transposed_aggregator(live, 31, torch.float32, reduce, norm)
    freed = {t.data_ptr(): t.untyped_storage().nbytes() for t in as_csr(live).tensors() if t.numel()}
    del live
    gc.collect()
    keep, reused = _reuse_freed(freed, device)
    got = run(y.to(device))
    if device == "cuda":
        torch.cuda.synchronize()
        assert reused >= 1, "no freed address was handed out again: the test proved nothing"
    del keep
    longest = int(torch.bincount(g.indices.long()).max())
    assert_close(got, a.t() @ y.double(), tolerance(torch.float32, longest), f"{reduce}/{norm} after the graph went")


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_aggregator_refuses_rows_of_another_shape_or_dtype(device: str) -> None:
    """Rows that do not match what the runner was resolved for (one per destination, the width, the dtype) are
    refused, naming the shapes, instead of being read out of bounds."""
    g = power_law_csr(60, 90, 400, seed=2, device=device)
    for reduce in ("sum", "mean"):
        run = transposed_aggregator(g, 8, torch.float32, reduce)
        with pytest.raises(FeatureShapeError, match=r"\(60, 8\)"):
            run(torch.randn(61, 8, device=device))
        with pytest.raises(FeatureShapeError, match=r"\(60, 8\)"):
            run(torch.randn(59, 8, device=device))
        with pytest.raises(FeatureShapeError, match="float32"):
            run(torch.randn(60, 8, device=device, dtype=torch.float64))
        with pytest.raises(FeatureShapeError):
            run(torch.randn(60, 9, device=device))
        assert run(torch.randn(60, 8, device=device)).shape == (90, 8)
