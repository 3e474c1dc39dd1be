"""The fuzz's typed bad-input cases: each corrupts one argument of a valid typed call (an unknown node type or
relation, ids outside a type's range, inputs that do not match their type) and expects the project's own
exception -- `HeteroGraphError`, `GraphFormatError`, `GraphIndexError`, `FeatureShapeError` or `SamplingError` --
whose message names the type, relation or argument, before any kernel runs; the CUDA context lives on.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from datapath import nn as dnn
from datapath.graph import HeteroGraph
from datapath.graph.hetero import HeteroGraphError
from datapath.ops import FeatureShapeError, GraphFormatError, GraphIndexError
from datapath.ops.typed import concat_inputs, relations_into, typed_linear
from datapath.sampling import HeteroBlock, HeteroNeighborSampler, SamplingError
from datapath.sampling.hetero_block import RelationBlock
from datapath.testing.fuzz_checks import Checks, _gen
from datapath.testing.fuzz_errors import expect_clear_error

TYPED_SCENARIOS = ("unknown_dst_type", "layer_missing_relation", "x_missing_type", "x_wrong_rows", "x_unknown_type",
                   "graph_unknown_type", "graph_src_out_of_range", "graph_dst_out_of_range", "graph_negative_id",
                   "check_ids_out_of_range", "sampler_seeds_out_of_range", "unknown_relation_name", "concat_widths",
                   "typed_linear_weights", "typed_linear_shape", "block_indices_out_of_range",
                   "block_indices_negative", "rgat_wrong_width", "hgt_wrong_width", "rgcn_wrong_width")
"""Every typed bad-input scenario."""


def _scenarios(gen: torch.Generator, device: Any) -> dict[str, tuple[type | tuple[type, ...], str, Callable[[], Any]]]:
    """name -> (the exception class(es) expected, the word its message must contain, the bad call)."""
    n = {"paper": 30, "author": 20, "venue": 5}
    ei = lambda s, d, e: torch.stack([torch.randint(0, n[s], (e,), generator=gen),  # noqa: E731
                                      torch.randint(0, n[d], (e,), generator=gen)])
    rels = {("author", "writes", "paper"): ei("author", "paper", 60),
            ("paper", "cites", "paper"): ei("paper", "paper", 80), ("paper", "in", "venue"): ei("paper", "venue", 30)}
    hg = HeteroGraph(n, rels)
    g = hg.to("cuda") if torch.device(device).type == "cuda" else hg
    x = {t: torch.randn(c, 8, generator=gen).to(device) for t, c in n.items()}
    ets = hg.edge_types
    rgcn = dnn.RGCNConv(8, 4, ets).to(device)

    def bad_ids(which: int, value: int) -> dict:
        out = {et: v.clone() for et, v in rels.items()}
        out[("author", "writes", "paper")][which, 7] = value
        return out

    def bad_block(value: int) -> HeteroBlock:
        """A user-made block whose 'writes' relation says it was not checked (trusted=False) and reads a bad id."""
        rel = {}
        for et, r in g.relations.items():
            ip, ix = r.indptr.long(), r.indices.long().clone()
            if et[1] == "writes" and ix.numel():
                ix[ix.numel() // 2] = value
            rel[et] = RelationBlock(ip, ix, n[et[0]], n[et[2]], trusted=False)
        return HeteroBlock({t: torch.arange(c, device=device) for t, c in n.items()}, dict(n), rel)

    return {
        "unknown_dst_type": (GraphFormatError, "'institute'", lambda: relations_into(g, "institute")),
        "layer_missing_relation": (GraphFormatError, "cites", lambda: dnn.RGCNConv(8, 4, [ets[0], ets[2]]).to(device)(
            g, x)),
        "x_missing_type": (FeatureShapeError, "'author'", lambda: rgcn(
            g, {k: v for k, v in x.items() if k != "author"})),
        "x_wrong_rows": (FeatureShapeError, "'venue'", lambda: rgcn(g, {**x, "venue": x["venue"][:-1]})),
        "x_unknown_type": (FeatureShapeError, "'institute'", lambda: rgcn(g, {**x, "institute": x["venue"]})),
        "graph_unknown_type": (HeteroGraphError, "'institute'", lambda: HeteroGraph(
            n, {**rels, ("author", "at", "institute"): ei("author", "venue", 4)})),
        "graph_src_out_of_range": (HeteroGraphError, "'author'", lambda: HeteroGraph(n, bad_ids(0, n["author"]))),
        "graph_dst_out_of_range": (HeteroGraphError, "'paper'", lambda: HeteroGraph(n, bad_ids(1, n["paper"] + 3))),
        "graph_negative_id": (HeteroGraphError, "'author'", lambda: HeteroGraph(n, bad_ids(0, -1))),
        "check_ids_out_of_range": (HeteroGraphError, "'venue'", lambda: hg.check_ids(
            "venue", torch.tensor([0, n["venue"]]))),
        "sampler_seeds_out_of_range": (SamplingError, "'paper'", lambda: HeteroNeighborSampler([2]).sample(
            hg, {"paper": torch.tensor([1, n["paper"]])})),
        "unknown_relation_name": (HeteroGraphError, "'rates'", lambda: hg.edge_type("rates")),
        "concat_widths": (FeatureShapeError, "widths", lambda: concat_inputs(g, {**x, "venue": x["venue"][:, :5]})),
        "typed_linear_weights": (FeatureShapeError, "weight", lambda: typed_linear(
            [x["paper"], x["author"]], [torch.randn(8, 3, device=device)])),
        "typed_linear_shape": (FeatureShapeError, "weight", lambda: typed_linear(
            [x["paper"]], [torch.randn(7, 3, device=device)])),
        "block_indices_out_of_range": ((GraphIndexError, GraphFormatError), "indices", lambda: rgcn(
            bad_block(n["author"]), x)),
        "block_indices_negative": ((GraphIndexError, GraphFormatError), "indices", lambda: rgcn(bad_block(-1), x)),
        "rgcn_wrong_width": (FeatureShapeError, "'paper'", lambda: rgcn(g, {**x, "paper": x["paper"][:, :6]})),
        "rgat_wrong_width": (FeatureShapeError, "'paper'", lambda: dnn.RGATConv(8, 4, ets, heads=2).to(device)(
            g, {**x, "paper": x["paper"][:, :6]})),
        "hgt_wrong_width": (FeatureShapeError, "'paper'", lambda: dnn.HGTConv(8, 4, hg.metadata, heads=2).to(device)(
            g, {**x, "paper": x["paper"][:, :6]})),
    }


def check_typed_bad_input(params: dict[str, Any], device: Any, out: Checks) -> None:
    """Run scenario ``params["scenario"]``; raise `UnclearError` unless it raised the expected, named error."""
    name = params["scenario"]
    expected, word, call = _scenarios(_gen(params), device)[name]
    expect_clear_error(name, call, expected, word, out)
