"""datapath.ops.aggregate_transposed: the adjoint of aggregate, against autograd through aggregate and a dense
float64 reference; its bad input."""
from __future__ import annotations

import pytest
import torch

from datapath.ops import (
    FeatureShapeError,
    UnsupportedDtypeError,
    aggregate,
    aggregate_transposed,
    transposed_aggregator,
)
from datapath.testing import power_law_csr

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
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-5)
    run = transposed_aggregator(g, 24, torch.float32, reduce, norm)  # resolved once, then only launched
    torch.testing.assert_close(run(y), got)
    torch.testing.assert_close(run(2 * y), 2 * got)


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
