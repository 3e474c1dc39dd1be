"""datapath.ops.sddmm and edge_softmax against float64 references, on CPU and GPU."""
from __future__ import annotations

import pytest
import torch

from datapath.ops import FeatureShapeError, edge_softmax, sddmm
from datapath.testing import power_law_csr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def coo(g):  # noqa: ANN001, ANN202
    ip = g.indptr.cpu()
    rows = torch.repeat_interleave(torch.arange(g.num_dst_nodes), ip[1:] - ip[:-1])
    return rows, g.indices.cpu().long()


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(got.detach().cpu().double(), ref.detach().double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (4, 8), (8, 33), (2, 300)])
def test_sddmm_dot(device: str, shape: tuple[int, ...]) -> None:
    g = power_law_csr(90, 130, 700, seed=len(shape) + shape[-1], device=device)
    torch.manual_seed(0)
    a = torch.randn(g.num_dst_nodes, *shape, device=device, requires_grad=True)
    b = torch.randn(g.num_src_nodes, *shape, device=device, requires_grad=True)
    out = sddmm(g, a, b)
    e = g.indices.numel()
    assert out.shape == ((e,) if len(shape) == 1 else (e, shape[0]))
    gy = torch.randn_like(out)
    out.backward(gy)
    rows, cols = coo(g)
    a64 = a.detach().cpu().double().requires_grad_()
    b64 = b.detach().cpu().double().requires_grad_()
    ref = (a64[rows] * b64[cols]).sum(-1)
    ref.backward(gy.cpu().double())
    close(out, ref, 5e-5)
    close(a.grad, a64.grad, 5e-5)
    close(b.grad, b64.grad, 5e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["add", "mul"])
def test_sddmm_elementwise(device: str, op: str) -> None:
    g = power_law_csr(50, 70, 300, seed=1, device=device)
    a = torch.randn(50, 3, device=device, requires_grad=True)
    b = torch.randn(70, 3, device=device, requires_grad=True)
    out = sddmm(g, a, b, op=op)
    rows, cols = coo(g)
    ref = a.detach().cpu()[rows] + b.detach().cpu()[cols] if op == "add" else a.detach().cpu()[rows] * b.detach().cpu()[cols]
    close(out, ref)
    out.sum().backward()
    assert a.grad is not None and b.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [None, 1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_edge_softmax(device: str, heads: int | None, dtype: torch.dtype) -> None:
    g = power_law_csr(80, 100, 900, seed=3, device=device)
    e = g.indices.numel()
    torch.manual_seed(1)
    shape = (e,) if heads is None else (e, heads)
    s = (torch.randn(shape, device=device) * 4).to(dtype).requires_grad_()
    p = edge_softmax(g, s)
    assert p.shape == s.shape and p.dtype == dtype
    gy = torch.randn(shape, device=device).to(dtype)
    p.backward(gy)
    rows, _ = coo(g)
    s64 = s.detach().cpu().double().requires_grad_()
    s2 = s64.reshape(e, -1)
    ref = torch.empty_like(s2)
    ip = g.indptr.cpu()
    parts = []
    for d in range(g.num_dst_nodes):
        lo, hi = int(ip[d]), int(ip[d + 1])
        if hi > lo:
            parts.append(torch.softmax(s2[lo:hi], 0))
    ref = torch.cat(parts).reshape(shape)
    ref.backward(gy.cpu().double())
    tol = 2e-5 if dtype == torch.float32 else (8e-3 if dtype == torch.bfloat16 else 1e-3)
    close(p, ref, tol)
    close(s.grad, s64.grad, tol * 4)
    sums = torch.zeros(g.num_dst_nodes, dtype=torch.float64).index_add_(0, rows, p.detach().cpu().double().reshape(e, -1)[:, 0])
    nonempty = (ip[1:] - ip[:-1]) > 0
    close(sums[nonempty], torch.ones(int(nonempty.sum()), dtype=torch.float64), tol * 4)


def test_validation() -> None:
    g = power_law_csr(10, 12, 40, seed=0)
    e = g.indices.numel()
    with pytest.raises(FeatureShapeError, match="E="):
        edge_softmax(g, torch.randn(e + 1))
    with pytest.raises(FeatureShapeError, match="rows"):
        sddmm(g, torch.randn(11, 4), torch.randn(12, 4))
    with pytest.raises(FeatureShapeError, match="agree"):
        sddmm(g, torch.randn(10, 4), torch.randn(12, 5))
    with pytest.raises(ValueError, match="op"):
        sddmm(g, torch.randn(10, 4), torch.randn(12, 4), op="max")


@pytest.mark.parametrize("heads", [None, 3])
def test_edge_softmax_of_a_graph_without_edges(heads: int | None) -> None:
    """No edges: an empty result of the scores' shape (2-D scores with heads included), and GATConv runs."""
    from datapath.graph import CSRGraph
    from datapath.nn import GATConv

    g = CSRGraph(torch.zeros(6, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 5, 5)
    scores = torch.randn(0) if heads is None else torch.randn(0, heads)
    out = edge_softmax(g, scores)
    assert out.shape == scores.shape
    gat = GATConv(4, 2, heads=heads or 1)
    x = torch.randn(5, 4, requires_grad=True)
    y = gat(g, x)
    y.sum().backward()
    assert y.shape == (5, 2 * (heads or 1)) and x.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sddmm_elementwise_gradients_accumulate_in_float32(device: str, op: str, dtype: torch.dtype) -> None:
    """The gradients of ``a[dst] + b[src]`` / ``a[dst] * b[src]`` sum each node's edges (thousands here) in float32:
    within the float32-accumulation tolerance of the float64 reference, not the 16-bit dtype's growing error."""
    from datapath.ops.tolerance import assert_close, tolerance

    g = power_law_csr(40, 30, 8000, alpha=1.5, seed=3, device=device)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(40, 2, 3, generator=gen).to(dtype).to(device).requires_grad_()
    b = torch.randn(30, 2, 3, generator=gen).to(dtype).to(device).requires_grad_()
    out = sddmm(g, a, b, op)
    gy = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(gy.to(device))
    a64, b64 = (t.detach().cpu().double().requires_grad_() for t in (a, b))
    ip = g.indptr.cpu()
    dst = torch.repeat_interleave(torch.arange(40), ip[1:] - ip[:-1])
    src = g.indices.cpu().long()
    ref = a64[dst] + b64[src] if op == "add" else a64[dst] * b64[src]
    ref.backward(gy.double())
    longest = max(int((ip[1:] - ip[:-1]).max()), int(torch.bincount(src).max()))
    assert longest > 1000
    tol = tolerance(dtype, longest)
    assert_close(out, ref, tol, f"{op} forward")
    assert_close(a.grad, a64.grad, tol, f"{op} grad a")
    assert_close(b.grad, b64.grad, tol, f"{op} grad b")
