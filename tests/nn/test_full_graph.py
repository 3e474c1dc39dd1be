"""Full-graph GCN / GIN (the seed papers' experiment): same outputs as PyG, trains, prepares without waiting."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from datapath.nn import GCN, GIN, GINConv, build_full_graph_model
from datapath.testing import seed_graph

pytest.importorskip("torch_geometric")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gcn", "gin"])
def test_matches_pyg_and_trains(name: str, device: str) -> None:
    g, spec = seed_graph("cora", device=device)
    torch.manual_seed(0)
    x = torch.randn(g.num_dst_nodes, 48, device=device)
    y = x[:, : spec.num_classes].argmax(1)  # learnable from the node's own features
    ours = build_full_graph_model(name, 48, spec.num_classes, dropout=0.0).to(device)
    theirs = build_full_graph_model(name, 48, spec.num_classes, dropout=0.0, backend="pyg").to(device)
    theirs.load_state_dict(ours.state_dict())
    assert len(ours.convs) == (2 if name == "gcn" else 5)
    ours.prepare(g)
    out, ref = ours(g, x), theirs(g, x)
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(out / scale, ref / scale, rtol=1e-5, atol=1e-5)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(ref, y).backward()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        s = max(1.0, float(q.grad.abs().max()))
        torch.testing.assert_close(p.grad / s, q.grad / s, rtol=1e-4, atol=1e-5, msg=n)
    opt = torch.optim.Adam(ours.parameters(), lr=0.02)
    first = None
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(ours(g, x), y)
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert float(loss) < 0.8 * first


def test_gin_projects_first_only_when_exact() -> None:
    g, _ = seed_graph("citeseer")
    x = torch.randn(g.num_dst_nodes, 32, dtype=torch.float64)
    from datapath.ops import aggregate

    for lin in (nn.Linear(32, 8).double(), nn.Linear(32, 48).double(),
                nn.Sequential(nn.Linear(32, 8), nn.ReLU()).double()):  # narrowing, widening, not linear
        layer = GINConv(lin, eps=0.3)
        torch.testing.assert_close(layer(g, x), lin(aggregate(g, x) + 1.3 * x))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="model"):
        build_full_graph_model("sage", 4, 2)
    with pytest.raises(ValueError, match="backend"):
        GCN(4, 8, 2, backend="dgl")
    g, _ = seed_graph("citeseer")
    with pytest.raises(ValueError, match="rows"):
        GIN(4, 8, 2)(g, torch.randn(10, 4))
