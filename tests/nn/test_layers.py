"""datapath.nn layers against plain-PyTorch float64 references and PyG's layers (same weights)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from datapath.nn import GATConv, GCNConv, GINConv, SAGEConv
from datapath.graph import CSRGraph
from datapath.testing import power_law_csr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def block(device: str, num_dst: int = 60, num_src: int = 140, num_edges: int = 700, seed: int = 0) -> CSRGraph:
    return power_law_csr(num_dst, num_src, num_edges, seed=seed, device=device)


def symmetric_graph(device: str, n: int = 80, m: int = 300, seed: int = 0) -> CSRGraph:
    """An undirected graph (every edge in both directions): in-degree == out-degree."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (m,), generator=g)
    dst = torch.randint(0, n, (m,), generator=g)
    keep = src != dst  # loop-free, so PyG's add_remaining_self_loops and ours agree
    src, dst = src[keep], dst[keep]
    rows = torch.cat([dst, src])
    cols = torch.cat([src, dst])
    order = torch.argsort(rows * n + cols)
    rows, cols = rows[order], cols[order]
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(rows, minlength=n), 0, out=indptr[1:])
    return CSRGraph(indptr.to(device), cols.to(device), n, n)


def coo(g: CSRGraph) -> tuple[torch.Tensor, torch.Tensor]:
    ip = g.indptr.cpu()
    return torch.repeat_interleave(torch.arange(g.num_dst_nodes), ip[1:] - ip[:-1]), g.indices.cpu().long()


def dense(g: CSRGraph) -> torch.Tensor:
    rows, cols = coo(g)
    a = torch.zeros(g.num_dst_nodes, g.num_src_nodes, dtype=torch.float64)
    a.index_put_((rows, cols), torch.ones(rows.numel(), dtype=torch.float64), accumulate=True)
    return a


def run(layer: nn.Module, g: CSRGraph, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Output, parameter gradients and input gradient for a fixed random upstream gradient."""
    x = x.detach().clone().requires_grad_()
    out = layer(g, x)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out)
    out.backward(gy)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad.detach()


def compare(a: tuple, b: tuple, tol: float = 1e-4) -> None:  # noqa: ANN001
    out_a, g_a, x_a = a
    out_b, g_b, x_b = b
    kw = {"rtol": tol, "atol": tol}
    torch.testing.assert_close(out_a.cpu().double(), out_b.cpu().double(), **kw)
    torch.testing.assert_close(x_a.cpu().double(), x_b.cpu().double(), **kw)
    assert set(g_a) == set(g_b)
    for n in g_a:
        torch.testing.assert_close(g_a[n].cpu().double(), g_b[n].cpu().double(), **kw, msg=n)


# ---- plain PyTorch float64 references ------------------------------------------------------
class RefSAGE(nn.Module):
    def __init__(self, layer: SAGEConv, g: CSRGraph) -> None:
        super().__init__()
        self.l = copy.deepcopy(layer).double().cpu()
        a = dense(g)
        self.register_buffer("a_mean", a / a.sum(1, keepdim=True).clamp(min=1))

    def forward(self, g: CSRGraph, x: torch.Tensor) -> torch.Tensor:
        return self.l.lin_l(self.a_mean @ x) + self.l.lin_r(x[: g.num_dst_nodes])


class RefGCN(nn.Module):
    def __init__(self, layer: GCNConv, g: CSRGraph) -> None:
        super().__init__()
        self.l = copy.deepcopy(layer).double().cpu()
        a = dense(g)
        din = a.sum(1).clamp(min=1)
        dout = a.sum(0).clamp(min=1)
        self.register_buffer("a_n", a / din.sqrt()[:, None] / dout.sqrt()[None, :])

    def forward(self, g: CSRGraph, x: torch.Tensor) -> torch.Tensor:
        return self.a_n @ self.l.lin(x) + self.l.bias


class RefGIN(nn.Module):
    def __init__(self, layer: GINConv, g: CSRGraph) -> None:
        super().__init__()
        self.l = copy.deepcopy(layer).double().cpu()
        self.register_buffer("a", dense(g))

    def forward(self, g: CSRGraph, x: torch.Tensor) -> torch.Tensor:
        return self.l.nn(self.a @ x + (1 + self.l.eps) * x[: g.num_dst_nodes])


class RefGAT(nn.Module):
    def __init__(self, layer: GATConv, g: CSRGraph) -> None:
        super().__init__()
        self.l = copy.deepcopy(layer).double().cpu()
        self.rows, self.cols = coo(g)

    def forward(self, g: CSRGraph, x: torch.Tensor) -> torch.Tensor:
        l = self.l
        h = l.lin(x).view(x.shape[0], l.heads, l.out_channels)
        a_s = (h * l.att_src).sum(-1)
        a_d = (h[: g.num_dst_nodes] * l.att_dst).sum(-1)
        e = torch.nn.functional.leaky_relu(a_d[self.rows] + a_s[self.cols], l.negative_slope)
        outs = []
        for d in range(g.num_dst_nodes):
            m = self.rows == d
            if not bool(m.any()):
                outs.append(torch.zeros(l.heads, l.out_channels, dtype=x.dtype))
                continue
            alpha = torch.softmax(e[m], 0)
            outs.append((alpha[:, :, None] * h[self.cols[m]]).sum(0))
        out = torch.stack(outs)
        out = out.reshape(out.shape[0], -1) if l.concat else out.mean(1)
        return out + l.bias


def _strip(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("l."): v for k, v in grads.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sage_small", "sage_project_first", "gcn", "gin", "gat_concat", "gat_mean"])
def test_layer_matches_plain_reference(device: str, kind: str) -> None:
    torch.manual_seed(0)
    g = block(device, seed=len(kind))
    if kind == "sage_small":
        layer, ref_cls, fin = SAGEConv(8, 24), RefSAGE, 8
    elif kind == "sage_project_first":
        layer, ref_cls, fin = SAGEConv(40, 6), RefSAGE, 40
    elif kind == "gcn":
        layer, ref_cls, fin = GCNConv(30, 12), RefGCN, 30
        nn.init.uniform_(layer.bias)
    elif kind == "gin":
        layer = GINConv(nn.Sequential(nn.Linear(16, 20), nn.ReLU(), nn.Linear(20, 5)), eps=0.3, train_eps=True)
        ref_cls, fin = RefGIN, 16
    else:
        layer = GATConv(12, 5, heads=3, concat=(kind == "gat_concat"))
        nn.init.uniform_(layer.bias)
        ref_cls, fin = RefGAT, 12
    layer = layer.to(device)
    ref = ref_cls(layer, g)
    x = torch.randn(g.num_src_nodes, fin, device=device)
    got = run(layer, g, x)
    want_out, want_g, want_x = run(ref, g, x.cpu().double())
    compare(got, (want_out, _strip(want_g), want_x))


def _pyg():  # noqa: ANN202
    return pytest.importorskip("torch_geometric.nn")


def run_pyg(layer: nn.Module, edge_index: torch.Tensor, x: torch.Tensor, num_dst: int,
            bipartite: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    inp = (x, x[:num_dst]) if bipartite else x
    out = layer(inp, edge_index) if bipartite else layer(x, edge_index)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out)
    out.backward(gy)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad.detach()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin", "gat"])
def test_layer_matches_pyg(device: str, kind: str) -> None:
    pyg = _pyg()
    torch.manual_seed(1)
    if kind == "gcn":
        g = symmetric_graph(device)
        ours, theirs = GCNConv(24, 10), pyg.GCNConv(24, 10, add_self_loops=False)
        fin = 24
    else:
        g = block(device, seed=3)
        if kind == "sage":
            ours, theirs, fin = SAGEConv(20, 9), pyg.SAGEConv(20, 9), 20
        elif kind == "gin":
            mlp = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
            ours, theirs, fin = GINConv(copy.deepcopy(mlp), eps=0.2, train_eps=True), pyg.GINConv(
                copy.deepcopy(mlp), eps=0.2, train_eps=True), 10
        else:
            ours, theirs, fin = GATConv(12, 6, heads=4), pyg.GATConv(12, 6, heads=4, add_self_loops=False), 12
    theirs = theirs.to(device)
    for p in theirs.parameters():  # non-trivial biases too
        nn.init.uniform_(p, -0.5, 0.5)
    ours = ours.to(device)
    missing = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing.missing_keys, missing
    rows, cols = coo(g)
    edge_index = torch.stack([cols, rows]).to(device)
    x = torch.randn(g.num_src_nodes, fin, device=device)
    got = run(ours, g, x)
    want = run_pyg(theirs, edge_index, x, g.num_dst_nodes, bipartite=(kind != "gcn"))
    compare(got, want, 2e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_pair_input_and_fused_src_ids(device: str) -> None:
    torch.manual_seed(2)
    g = block(device, seed=5)
    layer = SAGEConv(16, 8).to(device)
    table = torch.randn(500, 16)
    if device == "cuda":
        table = table.pin_memory()
    ids = torch.randperm(500)[: g.num_src_nodes].to(device)
    x = table.to(device)[ids]
    want = layer(g, x)
    torch.testing.assert_close(layer(g, (x, x[: g.num_dst_nodes])), want)
    with torch.no_grad():
        fused = layer(g, table, src_ids=ids)
    torch.testing.assert_close(fused, want.detach(), rtol=1e-5, atol=1e-5)
    gcn = GCNConv(16, 4).to(device)
    torch.testing.assert_close(gcn(g, table, src_ids=ids), gcn(g, x), rtol=1e-5, atol=1e-5)
    gat = GATConv(16, 4, heads=2).to(device)
    torch.testing.assert_close(gat(g, table, src_ids=ids), gat(g, x), rtol=1e-5, atol=1e-5)


def test_gcn_self_loops_and_sage_variants() -> None:
    torch.manual_seed(3)
    g = symmetric_graph("cpu", seed=4)
    x = torch.randn(g.num_src_nodes, 6)
    layer = GCNConv(6, 3, add_self_loops=True)
    pyg = _pyg()
    theirs = pyg.GCNConv(6, 3)  # PyG adds self loops by default
    theirs.load_state_dict(layer.state_dict())
    rows, cols = coo(g)
    torch.testing.assert_close(layer(g, x), theirs(x, torch.stack([cols, rows])), rtol=1e-5, atol=1e-5)
    for aggr in ("sum", "max"):
        ours, ref = SAGEConv(6, 3, aggr=aggr), pyg.SAGEConv(6, 3, aggr=aggr)
        ours.load_state_dict(ref.state_dict())
        torch.testing.assert_close(ours(g, x), ref(x, torch.stack([cols, rows])), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="aggr"):
        SAGEConv(3, 3, aggr="median")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [(16, 5), (8, 8)])  # projected first / aggregated first
def test_gin_fixed_eps_follows_state_dict_and_reset(device: str, width: tuple[int, int]) -> None:
    """GINConv keeps ``1 + eps`` for a fixed eps between calls; a new eps (load_state_dict, reset) is used."""
    torch.manual_seed(0)
    for g in (symmetric_graph(device), block(device)):  # whole graph (x_dst is x itself) and a block
        layer = GINConv(nn.Linear(*width), eps=0.0).to(device)
        x = torch.randn(g.num_src_nodes, width[0], device=device)
        for eps in (0.0, 0.7, -0.4):
            state = layer.state_dict()
            state["eps"] = torch.tensor([eps])
            layer.load_state_dict(state)
            ref = RefGIN(layer, g)
            want = ref(g, x.double().cpu())
            got = layer(g, x)
            assert torch.allclose(got.double().cpu(), want, atol=1e-4), f"eps={eps}"
        layer.reset_parameters()  # eps back to its initial 0.0 (a .data write)
        ref = RefGIN(layer, g)
        assert float(layer.eps) == 0.0
        assert torch.allclose(layer(g, x).double().cpu(), ref(g, x.double().cpu()), atol=1e-4)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin", "gat"])
def test_layers_name_x_of_the_wrong_width_or_device(kind: str) -> None:
    """x of another width than in_channels, or on another device than the graph, is refused naming x before any
    matmul (not torch's shape or device error from inside the layer)."""
    from datapath.ops import DeviceMismatchError, FeatureShapeError

    g = power_law_csr(40, 40, 160, seed=2)
    layer = {"sage": lambda: SAGEConv(8, 4), "gcn": lambda: GCNConv(8, 4),
             "gin": lambda: GINConv(nn.Sequential(nn.Linear(8, 4), nn.ReLU())), "gat": lambda: GATConv(8, 4)}[kind]()
    with pytest.raises(FeatureShapeError, match="7 features but the layer takes 8"):
        layer(g, torch.randn(40, 7))
    if kind != "gcn":
        with pytest.raises(FeatureShapeError, match="x_dst has 9 features"):
            layer(g, (torch.randn(40, 8), torch.randn(40, 9)))
    assert layer(g, torch.randn(40, 8)).shape[0] == 40
    meta = torch.randn(40, 8, device="meta")
    with pytest.raises(DeviceMismatchError, match="x is on meta"):
        layer(g, meta)
