"""The fuzz's typed groups (typed ops, relational layers, add_self_loops, typed bad input) on the CPU, and their
float64 references against PyTorch Geometric's layers."""
from __future__ import annotations

import pytest
import torch

from datapath.nn import HGTConv, RGATConv, RGCNConv
from datapath.ops import typed as typed_ops
from datapath.sampling import HeteroBlock
from datapath.sampling.hetero_block import RelationBlock
from datapath.testing import fuzz_typed
from datapath.testing import fuzz_typed_reference as tref
from datapath.testing.fuzz import OPS, make_case, run_case, run_fuzz
from datapath.testing.fuzz_typed import TYPED_OPS, typed_graph
from datapath.testing.fuzz_typed_errors import TYPED_SCENARIOS, check_typed_bad_input


def _cases(op: str, n: int, seed: int = 3) -> list:
    return [run_case(make_case(seed, i, "cpu", ops=(op,))) for i in range(n)]


def test_the_typed_groups_are_drawn() -> None:
    assert set(TYPED_OPS) <= set(OPS)
    assert {make_case(1, i, "cpu", ops=TYPED_OPS).op for i in range(200)} == set(TYPED_OPS)


@pytest.mark.parametrize("op", [pytest.param(o, marks=pytest.mark.slow) if o == "rgat" else o
                                for o in TYPED_OPS if o != "typed_bad_input"])
def test_typed_cases_match_the_reference(op: str) -> None:
    results = _cases(op, 10)
    bad = [r for r in results if not r.ok]
    report = "\n".join(f"{r.summary()}\n  reproduce: python -c \"{r.reproduction()}\"" for r in bad)
    assert not bad, report
    assert sum(bool(r.checks) for r in results) >= 6  # a graph may have no relation into a destination


@pytest.mark.slow
def test_typed_runs_at_both_scales() -> None:
    for scale in ("cpu", "gpu"):
        results = run_fuzz(seed=11, count=60 if scale == "cpu" else 25, device="cpu", ops=TYPED_OPS, scale=scale)
        bad = [r for r in results if not r.ok]
        assert not bad, "\n".join(f"{r.summary()}\n  reproduce: python -c \"{r.reproduction()}\"" for r in bad)


@pytest.mark.parametrize("scenario", TYPED_SCENARIOS)
def test_typed_bad_input_raises_the_named_error(scenario: str) -> None:
    out: list = []
    check_typed_bad_input({"seed": 5, "scenario": scenario}, "cpu", out)  # raises UnclearError otherwise
    assert out == [(scenario, 0.0)]


def test_a_broken_stacked_mean_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fuzz_typed.stacked_mean
    monkeypatch.setattr(fuzz_typed, "stacked_mean", lambda into, x: real(into, x) * (1 + 1e-2))
    results = _cases("stacked_mean", 12)
    graded = [r for r in results if r.checks]
    assert graded and sum(r.status == "mismatch" for r in graded) >= len(graded) // 2


def test_a_merged_csr_missing_an_edge_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """`relations_into` listing one edge's source twice (another dropped) fails the structure check and the sums."""
    real = typed_ops._merge

    def broken(graph, dst_type, compact):  # noqa: ANN001, ANN202
        into = real(graph, dst_type, compact)
        ix = into.csr.indices
        if ix.numel() > 1 and bool((ix != ix[0]).any()):
            ix[int((ix != ix[0]).nonzero()[0])] = ix[0]
        return into

    monkeypatch.setattr(typed_ops, "_merge", broken)
    results = _cases("relations_into", 12)
    assert sum(r.status == "mismatch" and dict(r.checks).get("merged_csr", 0) > 1 for r in results) >= 3


def test_wrong_relation_weights_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (RGCNConv, RGATConv):
        real = cls.relation_weights
        monkeypatch.setattr(cls, "relation_weights", lambda self, real=real: real(self).flip(0))
    results = _cases("rgcn", 10) + _cases("rgat", 10)
    assert sum(r.status == "mismatch" for r in results) >= 6


def test_layers_on_a_block_without_relations() -> None:
    """A block that sampled no relation (seeds of a type nothing points to): root term and bias only."""
    block = HeteroBlock({"a": torch.arange(5), "b": torch.arange(3)}, {"a": 2, "b": 0}, {})
    x = {"a": torch.randn(5, 4, dtype=torch.float64), "b": torch.randn(3, 4, dtype=torch.float64)}
    conv = RGCNConv(4, 3, [("b", "r", "a")]).double()
    torch.testing.assert_close(conv(block, x)["a"], x["a"][:2] @ conv.root + conv.bias)
    rgat = RGATConv(4, 3, [("b", "r", "a")], heads=2).double()
    torch.testing.assert_close(rgat(block, x)["a"], rgat.bias.expand(2, -1))


def test_an_untrusted_relation_is_checked() -> None:
    rel = RelationBlock(torch.tensor([0, 2, 3]), torch.tensor([0, 7, 1]), 4, 2, trusted=False)
    block = HeteroBlock({"a": torch.arange(4)}, {"a": 2}, {("a", "r", "a"): rel})
    with pytest.raises(IndexError, match=r"relation \('a', 'r', 'a'\).*indices"):
        typed_ops.relations_into(block, "a")
    rel.indices[1] = 3  # valid now (a new block: the merged relations are kept per block)
    block = HeteroBlock({"a": torch.arange(4)}, {"a": 2}, {("a", "r", "a"): rel})
    assert typed_ops.relations_into(block, "a").csr.indices.numel() == 3


pyg = pytest.importorskip("torch_geometric.nn")


def _homogeneous(e: tref.TypedEdges, x: dict, ets: list) -> tuple:
    off = e.type_offsets()
    xs = torch.cat([x[t] for t in e.num_src])
    ei = torch.cat([torch.stack([e.src[et] + off[et[0]], e.dst[et] + off[et[2]]]) for et in e.src], 1)
    typ = torch.cat([torch.full((e.src[et].numel(),), ets.index(et)) for et in e.src])
    return xs, ei, typ, off


def _graph(seed: int, kind: str) -> tuple:
    params = {"graph_seed": seed, "scale": "cpu", "edge_budget": 60_000, "kind": kind, "width": 6}
    g = typed_graph(params, "cpu")
    return g, tref.TypedEdges.of(g)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("decomp", [{}, {"num_bases": 2}, {"num_blocks": 2}])
def test_rgcn_and_rgat_references_are_pygs(seed: int, decomp: dict) -> None:
    g, e = _graph(seed, "whole")
    ets = list(e.src)
    torch.manual_seed(seed)
    x = {t: torch.randn(n, 6, dtype=torch.float64) for t, n in e.num_src.items()}
    xs, ei, typ, off = _homogeneous(e, x, ets)
    for ours, theirs in ((RGCNConv(6, 4, ets, **decomp), pyg.RGCNConv(6, 4, len(ets), **decomp)),
                         (RGATConv(6, 4, ets, heads=2, **decomp), pyg.RGATConv(6, 4, len(ets), heads=2, **decomp))):
        ours = ours.double()
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_(0, 0.5)
        theirs = theirs.double()
        theirs.load_state_dict(ours.state_dict(), strict=False)
        want = theirs(xs, ei, typ)
        got = getattr(tref, "rgcn" if isinstance(ours, RGCNConv) else "rgat")(e, x, ours)
        for t, v in got.items():
            torch.testing.assert_close(v, want[off[t]: off[t] + e.num_dst[t]])


@pytest.mark.parametrize("seed", range(3))
def test_hgt_reference_is_pygs(seed: int) -> None:
    g, e = _graph(seed, "block")
    types, ets = list(e.num_src), list(e.src)
    torch.manual_seed(seed)
    ours = HGTConv(6, 6, (types, ets), heads=2).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.5)
    theirs = pyg.HGTConv(6, 6, (types, ets), heads=2).double()
    theirs.load_state_dict(ours.state_dict())
    x = {t: torch.randn(n, 6, dtype=torch.float64) for t, n in e.num_src.items()}
    want = theirs(x, {et: torch.stack([e.src[et], e.dst[et]]) for et in ets})
    got = tref.hgt(e, x, ours)
    for t, v in got.items():
        torch.testing.assert_close(v, want[t][: e.num_dst[t]])
