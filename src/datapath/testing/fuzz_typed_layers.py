"""The fuzz's relational layer groups: `datapath.nn.RGCNConv` (no decomposition, basis, block-diagonal),
`RGATConv` and `HGTConv` on random typed graphs (`datapath.testing.fuzz_typed.typed_graph`), forward and every
gradient (each node type's inputs, every parameter) against `datapath.testing.fuzz_typed_reference` in float64.

The layer is built for the graph's relations, in a random order and with relations the graph lacks (a layer
built for a dataset's metadata, run on a block that samples fewer); its float64 CPU copy is the reference's.
"""
from __future__ import annotations

import copy
import random
from typing import Any

import torch
from torch import nn

from datapath import nn as dnn
from datapath.ops.tolerance import tolerance
from datapath.testing import fuzz_checks as C
from datapath.testing import fuzz_typed_reference as tref
from datapath.testing.fuzz_checks import DTYPES, Checks, _gen, _half_lib, ratio, values
from datapath.testing.fuzz_typed import TYPED_STAGES, _inputs, _Shape, typed_graph

LAYERS = ("rgcn", "rgat", "hgt")


def _metadata(params: dict[str, Any], e: tref.TypedEdges) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The layer's node and edge types: the graph's, maybe permuted, maybe with relations the graph lacks."""
    rng = random.Random(params["seed"])
    types = list(e.num_src)
    ets = list(e.src)
    if params.get("extra") or not ets:  # a block may sample no relation at all: the layer still has some
        ets += [(rng.choice(types), f"extra{i}", rng.choice(types)) for i in range(rng.randint(1, 2))]
    if params.get("permute"):
        rng.shuffle(ets)
        rng.shuffle(types)
    return types, ets


def _divisor(n: int, want: int) -> int:
    return max(b for b in range(1, want + 1) if n % b == 0)


def make_layer(params: dict[str, Any], e: tref.TypedEdges, widths: dict[str, int]) -> nn.Module:
    """The case's layer (seeded by the case), built for ``e``'s relations (`_metadata`)."""
    torch.manual_seed(int(params["seed"]))
    op, k_in, out, heads = params["op"], params["width"], params["out"], params["heads"]
    types, ets = _metadata(params, e)
    decomp = params.get("decomp", "none")
    kw: dict[str, Any] = {}
    if decomp == "bases":
        kw["num_bases"] = params["bases"]
    elif decomp == "blocks":
        kw["num_blocks"] = _divisor(k_in, params["blocks"])
    if op == "rgcn":
        if "num_blocks" in kw:  # it must divide both widths
            kw["num_blocks"] = max(b for b in range(1, params["blocks"] + 1) if k_in % b == 0 and out % b == 0)
        return dnn.RGCNConv(k_in, out, ets, root_weight=params["root"], bias=params["bias"], **kw)
    if op == "rgat":
        if "num_blocks" in kw:
            kw["num_blocks"] = max(b for b in range(1, params["blocks"] + 1) if k_in % b == 0 and
                                   (heads * out) % b == 0)
        return dnn.RGATConv(k_in, out, ets, heads=heads, concat=params["concat"], bias=params["bias"], **kw)
    ins = widths if params.get("per_type_widths") else k_in
    return dnn.HGTConv(ins, out, (types, ets), heads=heads)


def check_typed_layer(params: dict[str, Any], device: Any, out: Checks) -> None:
    """RGCNConv / RGATConv / HGTConv against their float64 definitions."""
    op, dtype = params["op"], DTYPES[params["dtype"]]
    g = typed_graph(params, device)
    C.LAST_GRAPH[:] = [id(g)]
    e = tref.TypedEdges.of(g)
    gen = _gen(params)
    k_in = params["width"]
    if op == "hgt" and params.get("same_width"):
        k_in = params["width"] = params["out"]
    widths = {t: k_in for t in e.num_src}
    if op == "hgt" and params.get("per_type_widths"):
        widths = {t: (k_in if i % 2 == 0 else max(1, (k_in * 3 + i) % 96)) for i, t in enumerate(e.num_src)}
    conv = make_layer(params, e, widths).to(device, dtype)
    ref_conv = copy.deepcopy(conv).to("cpu", torch.float64)
    x, x64 = _inputs(gen, e, widths, dtype, device)
    got = conv(g, x)
    want = getattr(tref, op)(e, x64, ref_conv)
    sh = _Shape(e)
    heads, f_out = params["heads"], params["out"]
    nr = max(1, len(e.src))
    wide = max(k_in, *widths.values(), f_out * heads)
    # terms behind one value: a merged row's or column's edges, the matmuls' inner widths (the stacked R*in of
    # R-GCN, the heads' channels), and for a weight's gradient the rows it sums over
    row = sh.max_in + sh.max_out + nr * wide + wide + sh.rows
    reps = sh.rep_in + sh.rep_out
    half = dtype in (torch.float16, torch.bfloat16)
    depth = TYPED_STAGES[op] + int(params.get("decomp") == "bases")
    if op != "rgcn" and half:  # attention terms rounded to the layer's dtype one by one (as GAT's; fuzz_checks)
        t = tolerance(dtype, sh.max_in + sh.max_out + wide, "operand", depth=depth, repeats=reps)
    else:
        t = tolerance(dtype, row, _half_lib(dtype, None, sh.max_in + sh.max_out), depth=depth, repeats=reps)
    out.append(("types", 0.0 if set(got) == set(want) else float("inf")))
    for k in want:
        out.append((f"forward[{k}]", ratio(got.get(k), want[k], t)))
    if not any(v.requires_grad for v in got.values()):
        return
    kinks = tref.rgat_kinks(e, x64, ref_conv, torch.finfo(dtype).eps / 2) if op == "rgat" else {}
    loss, loss64 = 0, 0
    for k in want:
        gy = values(gen, tuple(want[k].shape), dtype, "cpu")
        if k in kinks:  # a score at LeakyReLU's kink: its gradient may take either slope
            gy = gy.masked_fill(kinks[k].reshape(-1, 1), 0)
        if k in got and got[k].requires_grad:
            loss = loss + (got[k] * gy.to(device)).sum()
        loss64 = loss64 + (want[k] * gy.double()).sum()
    if isinstance(loss, torch.Tensor):
        loss.backward()
    if isinstance(loss64, torch.Tensor) and loss64.requires_grad:
        loss64.backward()
    for k in x64:
        out.append((f"grad_x[{k}]", ratio(x[k].grad, x64[k].grad, t)))
    theirs = dict(ref_conv.named_parameters())
    for name, p in conv.named_parameters():
        tp = t
        if p.numel() == 1 or name in ("q", "k", "comp", "att") or name.startswith(("p_rel", "skip")):
            # broadcast factors: their gradient sums a product per row and column (each rounded to the layer's
            # dtype in 16 bits: "operand" sums), as GAT's attention vectors in fuzz_checks.check_layer
            tp = tolerance(dtype, row + sh.rows * wide, "operand" if half else None, depth=depth, repeats=reps)
        out.append((f"grad_{name}", ratio(p.grad, theirs[name].grad, tp)))
