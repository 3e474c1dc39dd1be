"""The layers' one-node path (GCN, GIN with one Linear, GraphSAGE projecting first): outputs and every gradient
against a float64 dense reference, on whole graphs, blocks and (x_src, x_dst) pairs, with and without an input
gradient, a bias, a root weight or a trainable eps."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from datapath.graph import CSRGraph
from datapath.nn import GCNConv, GINConv, SAGEConv
from datapath.ops.tolerance import assert_close, tolerance
from datapath.testing import power_law_csr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dense(g: CSRGraph) -> torch.Tensor:
    ip = g.indptr.cpu()
    rows = torch.repeat_interleave(torch.arange(g.num_dst_nodes), ip[1:] - ip[:-1])
    a = torch.zeros(g.num_dst_nodes, g.num_src_nodes, dtype=torch.float64)
    a.index_put_((rows, g.indices.cpu().long()), torch.ones(rows.numel(), dtype=torch.float64), accumulate=True)
    return a


def reference(layer: nn.Module, g: CSRGraph, a: torch.Tensor, xs: torch.Tensor, xd: torch.Tensor) -> torch.Tensor:
    """The layer's function in float64 from its (deep-copied) parameters."""
    if isinstance(layer, GCNConv):
        an = a / a.sum(1, keepdim=True).clamp(min=1).sqrt() / a.sum(0, keepdim=True).clamp(min=1).sqrt()
        out = an @ layer.lin(xs)
        return out + layer.bias if layer.bias is not None else out
    if isinstance(layer, GINConv):
        am = a / a.sum(1, keepdim=True).clamp(min=1) if layer.aggr == "mean" else a
        return layer.nn(am @ xs + (1 + layer.eps) * xd)
    am = a / a.sum(1, keepdim=True).clamp(min=1) if layer.aggr == "mean" else a
    out = layer.lin_l(am @ xs)
    return out + layer.lin_r(xd) if layer.lin_r is not None else out


LAYERS = {
    "gcn": lambda: GCNConv(24, 8),
    "gcn_nobias": lambda: GCNConv(24, 8, bias=False),
    "gin": lambda: GINConv(nn.Linear(24, 8), eps=0.4),
    "gin_square_train_eps_mean": lambda: GINConv(nn.Linear(24, 24), eps=-0.2, train_eps=True, aggr="mean"),
    "sage_mean": lambda: SAGEConv(24, 8),
    "sage_sum_noroot": lambda: SAGEConv(24, 8, aggr="sum", root_weight=False),
    "sage_nobias_normalize": lambda: SAGEConv(24, 8, bias=False, normalize=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("shape", ["whole", "block", "pair", "frozen_input"])
def test_one_node_layer_matches_reference(device: str, kind: str, shape: str) -> None:
    torch.manual_seed(0)
    if shape in ("whole", "frozen_input"):
        g = power_law_csr(150, 150, 1200, seed=2, device=device)
    else:
        g = power_law_csr(70, 160, 900, seed=3, device=device)
    if kind.startswith("gcn") and shape in ("block", "pair"):
        pytest.skip("GCNConv takes the source rows only")
    layer = LAYERS[kind]().to(device)
    for p in layer.parameters():
        nn.init.uniform_(p, -0.5, 0.5)
    ref = copy.deepcopy(layer).double().cpu()
    nd = g.num_dst_nodes
    xs = torch.randn(g.num_src_nodes, 24, device=device, requires_grad=shape != "frozen_input")
    xd = torch.randn(nd, 24, device=device, requires_grad=True) if shape == "pair" else None
    out = layer(g, (xs, xd)) if xd is not None else layer(g, xs)
    gy = torch.randn(out.shape, device=device)
    out.backward(gy)
    rxs = xs.detach().cpu().double().requires_grad_()
    rxd = xd.detach().cpu().double().requires_grad_() if xd is not None else rxs[:nd]
    want = reference(ref, g, dense(g), rxs, rxd)
    if isinstance(ref, SAGEConv) and ref.normalize:
        want = nn.functional.normalize(want, dim=-1)
    want.backward(gy.cpu().double())
    # a layer: projection, aggregation, root term, bias (depth 4); a weight's gradient sums over every row
    tol = tolerance(torch.float32, g.indices.numel() + g.num_src_nodes + 2 * 24, depth=4)
    assert_close(out, want, tol, f"{kind} {shape} forward")
    if xs.requires_grad:
        assert_close(xs.grad, rxs.grad, tol, f"{kind} {shape} grad x_src")
    if xd is not None:
        assert (xd.grad is None) == (rxd.grad is None)  # None: x_dst unused (no root weight)
        if xd.grad is not None:
            assert_close(xd.grad, rxd.grad, tol, f"{kind} {shape} grad x_dst")
    got_p, want_p = dict(layer.named_parameters()), dict(ref.named_parameters())
    assert set(got_p) == set(want_p)
    for name, p in got_p.items():
        assert_close(p.grad, want_p[name].grad, tol, f"{kind} {shape} grad {name}")


def test_one_node_layer_refuses_double_backward_and_keeps_other_paths() -> None:
    g = power_law_csr(40, 40, 200, seed=1)
    layer = GCNConv(6, 3)
    x = torch.randn(40, 6, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(g, x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        gx.sum().backward()
    w = torch.rand(g.indices.numel(), requires_grad=True)  # an edge weight takes the op-by-op path: its gradient flows
    layer(g, x, edge_weight=w).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
