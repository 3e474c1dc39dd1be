"""The layers' per-call input path: bad x refused naming x, GIN's width read from its current nn, and an
inference call (grad mode off) that resolves nothing for a backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from datapath.nn import GCNConv, GINConv, SAGEConv
from datapath.ops import FeatureShapeError, cached_keys
from datapath.testing import power_law_csr


def _layer(kind: str) -> nn.Module:
    # every one projects before it aggregates (in > out): the one-node path
    return {"sage": lambda: SAGEConv(12, 5), "gcn": lambda: GCNConv(12, 5),
            "gin": lambda: GINConv(nn.Linear(12, 5))}[kind]()


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_x_that_is_no_2d_tensor_is_refused_naming_x(kind: str) -> None:
    g = power_law_csr(30, 30, 120, seed=4)
    layer = _layer(kind)
    with pytest.raises(FeatureShapeError, match="x must be a torch.Tensor"):
        layer(g, [[0.0] * 12] * 30)
    with pytest.raises(FeatureShapeError, match="x must be 2-D"):
        layer(g, torch.randn(30 * 12))
    with pytest.raises(FeatureShapeError, match="x must be 2-D"):
        layer(g, torch.randn(30, 3, 4))


def test_gin_checks_the_width_of_the_nn_it_has_now() -> None:
    """The width GIN checks x against follows its nn when the nn (or its first Linear) is replaced."""
    g = power_law_csr(30, 30, 120, seed=5)
    layer = GINConv(nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4)))
    assert layer(g, torch.randn(30, 12)).shape == (30, 4)
    layer.nn[0] = nn.Linear(6, 8)
    with pytest.raises(FeatureShapeError, match="12 features but the layer takes 6"):
        layer(g, torch.randn(30, 12))
    assert layer(g, torch.randn(30, 6)).shape == (30, 4)
    layer.nn = nn.Linear(9, 3)
    with pytest.raises(FeatureShapeError, match="6 features but the layer takes 9"):
        layer(g, torch.randn(30, 6))
    layer.nn = nn.Sequential(nn.Identity(), nn.Linear(7, 3))  # no Linear first: the width is not known up front
    assert layer(g, torch.randn(30, 7)).shape == (30, 3)


def _backward_specs(g: object) -> list:
    return [k for k in cached_keys(g) if isinstance(k, tuple) and k[:1] == ("spec",) and k[-1] is True]


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_inference_call_gives_the_training_output_and_resolves_no_backward(kind: str, mode: str) -> None:
    torch.manual_seed(0)
    layer = _layer(kind)
    x = torch.randn(50, 12, dtype=torch.float64)
    layer = layer.double()
    fresh = power_law_csr(50, 50, 260, seed=6)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        got = layer(fresh, x)
    assert got.grad_fn is None
    assert _backward_specs(fresh) == []  # nothing prepared for a gradient that cannot come
    want = layer(fresh, x.clone().requires_grad_(True))  # the training call: one autograd node
    assert want.grad_fn is not None
    assert _backward_specs(fresh) != []  # ... which does resolve its backward (the check above can fail)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
