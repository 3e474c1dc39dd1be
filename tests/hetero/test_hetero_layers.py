"""RGCNConv / RGATConv / HGTConv against PyG's layers (float64, CPU; weights copied): outputs and gradients."""
from __future__ import annotations

import pytest
import torch

from datapath.nn import HeteroGNN, HGTConv, RGATConv, RGCNConv
from datapath.ops import FeatureShapeError, GraphFormatError
from datapath.sampling import HeteroNeighborSampler

pyg_nn = pytest.importorskip("torch_geometric.nn")


def _block(hetero, seed: int = 0):
    hg, _, _ = hetero(seed, scale=2)
    blocks = HeteroNeighborSampler([4, 3], seed=seed).sample(
        hg, {"paper": torch.arange(0, 40, 3), "author": torch.tensor([1, 4, 6])})
    return hg, blocks[0]


def _inputs(block, width: int, dtype=torch.float64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t: torch.randn(n, width, generator=g, dtype=dtype).requires_grad_() for t, n in block.num_src_nodes.items()}


def _homogeneous(block, x, edge_types):
    """PyG's homogeneous form: x stacked by type, edge_index with per-type offsets, edge_type = relation id."""
    off, acc = {}, 0
    for t in block.node_types:
        off[t] = acc
        acc += block.num_src_nodes[t]
    xs = torch.cat([x[t] for t in block.node_types])
    eis, typ = [], []
    for et, ei in block.to_pyg().items():
        eis.append(torch.stack([ei[0] + off[et[0]], ei[1] + off[et[2]]]))
        typ.append(torch.full((ei.shape[1],), edge_types.index(et)))
    return xs, torch.cat(eis, 1), torch.cat(typ), off


def _compare(block, ours, theirs, x, x_pyg, params_pyg, params_ours, rtol=1e-9):
    g = torch.Generator().manual_seed(99)
    loss_o = loss_t = 0.0
    for t, o in ours.items():
        ref = theirs[t][: block.num_dst_nodes[t]]
        torch.testing.assert_close(o, ref, rtol=rtol, atol=rtol)
        w = torch.randn(o.shape, generator=g, dtype=o.dtype)
        loss_o = loss_o + (o * w).sum()
        loss_t = loss_t + (ref * w).sum()
    assert ours
    loss_o.backward()
    loss_t.backward()
    for t in x:  # a type no output reads gets no gradient (PyG: zeros)
        got = x[t].grad if x[t].grad is not None else torch.zeros_like(x[t])
        torch.testing.assert_close(got, x_pyg(t), rtol=rtol, atol=rtol)
    for name, p in params_ours.items():
        if p.grad is None:
            continue
        ref = params_pyg[name].grad  # a parameter of a relation absent from the block: None in PyG, zeros here
        ref = ref if ref is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.grad, ref, rtol=rtol, atol=rtol, msg=name)


def _split_grad(xs, off, block):
    return lambda t: xs.grad[off[t]: off[t] + block.num_src_nodes[t]]


def _compare_homogeneous(block, ours, theirs, x, ets):
    """`_compare` against a PyG layer run on the homogeneous form (edge_type = relation id)."""
    xs, ei, et, off = _homogeneous(block, {t: v.detach() for t, v in x.items()}, ets)
    xs.requires_grad_()
    out_t = theirs(xs, ei, et)
    out_t = {t: out_t[off[t]: off[t] + block.src_nodes[t].numel()] for t in block.node_types}
    _compare(block, ours(block, x), out_t, x, _split_grad(xs, off, block), dict(theirs.named_parameters()),
             dict(ours.named_parameters()))


@pytest.mark.parametrize("decomp", [{}, {"num_bases": 3}, {"num_blocks": 4}])
def test_rgcn_matches_pyg(hetero, decomp) -> None:
    hg, block = _block(hetero, 1)
    ets = hg.edge_types
    ours = RGCNConv(16, 12, ets, **decomp).double()
    theirs = pyg_nn.RGCNConv(16, 12, len(ets), **decomp).double()
    theirs.load_state_dict(ours.state_dict())
    x = _inputs(block, 16)
    _compare_homogeneous(block, ours, theirs, x, ets)


def test_rgcn_on_a_whole_graph(hetero) -> None:
    hg, n, _ = hetero(2)
    ours = RGCNConv(8, 5, hg.edge_types).double()
    theirs = pyg_nn.RGCNConv(8, 5, len(hg.edge_types)).double()
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(1)
    x = {t: torch.randn(c, 8, generator=g, dtype=torch.float64) for t, c in n.items()}
    off = dict(zip(n, torch.tensor([0, *n.values()]).cumsum(0).tolist()))
    ei = torch.cat([torch.stack([e[0] + off[et[0]], e[1] + off[et[2]]]) for et, e in hg.edge_index_dict().items()], 1)
    typ = torch.cat([torch.full((hg[et].num_edges,), i) for i, et in enumerate(hg.edge_types)])
    ref = theirs(torch.cat(list(x.values())), ei, typ)
    out = ours(hg, x)
    for t in n:
        torch.testing.assert_close(out[t], ref[off[t]: off[t] + n[t]])


@pytest.mark.parametrize("kw", [{"heads": 1}, {"heads": 3}, {"heads": 2, "num_bases": 2}, {"heads": 2, "num_blocks": 2},
                                {"heads": 2, "concat": False}])
def test_rgat_matches_pyg(hetero, kw) -> None:
    hg, block = _block(hetero, 3)
    ets = hg.edge_types
    ours = RGATConv(8, 6, ets, **kw).double()
    theirs = pyg_nn.RGATConv(8, 6, len(ets), **kw).double()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"w", "l1", "b1", "l2", "b2"}
    with torch.no_grad():  # random q/k/bias so that the attention is not uniform
        for p in (ours.q, ours.k, ours.bias):
            p.normal_()
    theirs.load_state_dict(ours.state_dict(), strict=False)
    x = _inputs(block, 8, seed=3)
    _compare_homogeneous(block, ours, theirs, x, ets)


@pytest.mark.parametrize("heads,width", [(1, 8), (2, 8), (4, 12)])
def test_hgt_matches_pyg(hetero, heads, width) -> None:
    hg, block = _block(hetero, 4)
    ours = HGTConv(8, width, hg.metadata, heads=heads).double()
    theirs = pyg_nn.HGTConv(8, width, hg.metadata, heads=heads).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.5)
    theirs.load_state_dict(ours.state_dict())
    x = _inputs(block, 8, seed=4)
    xt = {t: v.detach().clone().requires_grad_() for t, v in x.items()}
    out_t = theirs(xt, block.to_pyg())
    _compare(block, ours(block, x), out_t, x, lambda t: xt[t].grad, dict(theirs.named_parameters()),
             dict(ours.named_parameters()))


def test_float32_close_to_float64(hetero) -> None:
    hg, block = _block(hetero, 5)
    for layer in (RGCNConv(8, 8, hg.edge_types), RGATConv(8, 4, hg.edge_types, heads=2), HGTConv(8, 8, hg.metadata, 2)):
        x = _inputs(block, 8, dtype=torch.float32, seed=5)
        out32 = layer(block, x)
        out64 = layer.double()(block, {t: v.detach().double() for t, v in x.items()})
        for t in out32:
            torch.testing.assert_close(out32[t].double(), out64[t], rtol=1e-4, atol=1e-4)


def test_bad_inputs_name_the_type(hetero) -> None:
    hg, block = _block(hetero, 6)
    layer = RGCNConv(8, 4, hg.edge_types)
    x = _inputs(block, 8, dtype=torch.float32)
    x["author"] = x["author"][:-1]
    with pytest.raises(FeatureShapeError, match="'author'"):
        layer(block, x)
    with pytest.raises(GraphFormatError, match="cites"):
        RGCNConv(8, 4, hg.edge_types[1:])(block, _inputs(block, 8, dtype=torch.float32))
    x = _inputs(block, 8, dtype=torch.float32)
    del x["author"]
    with pytest.raises(FeatureShapeError, match="'author'"):  # a relation reads a type with no rows
        layer(block, x)


def test_bad_model_inputs_name_the_type(hetero) -> None:
    hg, block = _block(hetero, 7)
    model = HeteroGNN("rgat", hg.metadata, {"paper": 8, "author": 5}, hg.num_nodes, 8, 3, num_layers=1, heads=2)
    x = {"paper": torch.randn(block.num_src_nodes["paper"], 8), "author": torch.randn(block.num_src_nodes["author"], 5)}
    assert model([block], x).shape == (block.num_dst_nodes["paper"], 3)
    for bad, match in (({**x, "author": x["author"][:, :4]}, "'author'.*5 features"),
                       ({**x, "fos": torch.randn(block.num_src_nodes["fos"], 8)}, "'fos'"),
                       ({**x, "venue": torch.randn(3, 8)}, "'venue'")):
        with pytest.raises(FeatureShapeError, match=match):
            model([block], bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-2)])
def test_layers_on_gpu_match_float64(hetero, cuda_device, dtype, tol) -> None:
    hg, _, _ = hetero(7, scale=20)
    blocks = HeteroNeighborSampler([6, 4], seed=2).sample(hg.to("unified"), ("paper", torch.arange(0, 600, 7).to(cuda_device)))
    block = blocks[0]
    cpu_block = block.to("cpu")
    for layer in (RGCNConv(16, 16, hg.edge_types, num_bases=3), RGATConv(16, 8, hg.edge_types, heads=2),
                  HGTConv(16, 16, hg.metadata, heads=4)):
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        x = _inputs(block, 16, dtype=torch.float64, seed=8)
        ref = layer.double()(cpu_block, x)
        (sum((v * v).sum() for v in ref.values())).backward()
        ref_grads = {t: v.grad.clone() for t, v in x.items() if v.grad is not None and v.numel()}
        xg = {t: v.detach().to(cuda_device, dtype).requires_grad_() for t, v in x.items()}
        out = layer.to(cuda_device, dtype)(block, xg)
        assert set(out) == set(ref)
        for t in out:
            assert out[t].dtype == dtype
            torch.testing.assert_close(out[t].double().cpu(), ref[t], rtol=tol, atol=tol)
        (sum((v.float() * v.float()).sum() for v in out.values())).backward()
        for t, g in ref_grads.items():
            scale = max(1.0, float(g.abs().max()))
            torch.testing.assert_close(xg[t].grad.double().cpu() / scale, g / scale, rtol=tol * 3, atol=tol * 3)
        layer.cpu()


def test_hgt_with_per_type_widths_matches_pyg(hetero) -> None:
    hg, block = _block(hetero, 9)
    widths = {t: 4 + 2 * i for i, t in enumerate(hg.node_types)}
    ours = HGTConv(widths, 8, hg.metadata, heads=2).double()
    theirs = pyg_nn.HGTConv(widths, 8, hg.metadata, heads=2).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.5)
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(9)
    x = {t: torch.randn(n, widths[t], generator=g, dtype=torch.float64).requires_grad_()
         for t, n in block.num_src_nodes.items()}
    xt = {t: v.detach().clone().requires_grad_() for t, v in x.items()}
    out_t = theirs(xt, block.to_pyg())
    _compare(block, ours(block, x), out_t, x, lambda t: xt[t].grad, dict(theirs.named_parameters()),
             dict(ours.named_parameters()))
