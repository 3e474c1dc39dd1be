"""A differential fuzz of every public op and layer against float64 references: random cases, seeded, reproducible.

    from datapath.testing.fuzz import make_case, run_case, run_fuzz
    results = run_fuzz(seed=0, count=300, device="cpu")           # the CI's few hundred cases
    bad = [r for r in results if not r.ok]
    print(bad[0].reproduction())                                  # a stand-alone snippet re-running that case

Case ``index`` of run ``seed`` is drawn by `make_case` from ``random.Random`` seeded by both alone, so any
case is re-made without the ones before it.  A run goes through its cases in index order, which is a random
order of ops, graphs, widths and dtypes, in one process; each case's tensors are freed before the next
(``gc.collect()`` now and then, ``torch.cuda.empty_cache()`` sometimes) so that new tensors land where freed
ones were -- what a cache keyed by ``id()`` or ``data_ptr()`` gets wrong.

Ops (`OPS`): ``aggregate`` (sum/mean/max, GCN norm, edge weights, heads; the default plan, each kernel forced
by a plan, or chosen by a probe limited to it; ``DATAPATH_OPS_PROBE`` on and off), ``aggregate_fused``
(``src_ids`` into cuda / unified / as_unified / pinned / cpu tables), ``aggregate_transposed`` (and
``transposed_aggregator``), ``sddmm``, ``edge_softmax``, the layers ``sage``, ``gcn``, ``gin``, ``gat``,
the full-graph models ``full_gcn``/``full_gin``, ``gather`` (the row fetch and its bad indices),
``bad_input`` (`datapath.testing.fuzz_errors`) and the typed groups of `datapath.testing.fuzz_typed`
(``typed_linear``, ``relations_into``, ``stacked_mean``, the relational layers ``rgcn``/``rgat``/``hgt``,
``add_self_loops``, ``typed_bad_input``).  Each compares forward and every gradient with
`datapath.testing.fuzz_reference` under `datapath.ops.tolerance`.
"""
from __future__ import annotations

import gc
import math
import os
import random
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from datapath.testing import fuzz_checks as C
from datapath.testing.fuzz_errors import SCENARIOS, UnclearError, check_bad_input
from datapath.testing.fuzz_graphs import GRAPH_KINDS, SQUARE_KINDS
from datapath.testing.fuzz_memory import check_gather
from datapath.testing.fuzz_typed import TYPED_OPS, TYPED_WEIGHTS, typed_params
from datapath.testing.fuzz_typed import check_add_self_loops, check_relations_into, check_stacked_mean, \
    check_typed_linear
from datapath.testing.fuzz_typed_errors import check_typed_bad_input
from datapath.testing.fuzz_typed_layers import check_typed_layer

OPS = ("aggregate", "aggregate_fused", "aggregate_transposed", "sddmm", "edge_softmax", "sage", "gcn", "gin", "gat",
       "full_gcn", "full_gin", "gather", "bad_input") + TYPED_OPS
"""Every op the fuzz draws (the typed groups: `datapath.testing.fuzz_typed`)."""
WEIGHTS = (30, 8, 5, 6, 5, 10, 6, 6, 6, 2, 2, 10, 4) + TYPED_WEIGHTS
EDGE_BUDGET = {"gpu": 800_000, "cpu": 60_000}
"""Edges x width per case: keeps the float64 reference cheap."""
WIDTHS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 255, 256, 257, 512, 602, 1023,
          1024)
ILLEGAL = ("illegal memory access", "illegal address", "illegal_address", "misaligned address",
           "unspecified launch failure", "device-side assert", "an illegal instruction")
"""Messages of CUDA errors that leave the context unusable: the run stops (a driver restarts it after the case)."""


@dataclass
class FuzzCase:
    """One case: ``op`` and its plain-value ``params`` (seeds, sizes, dtype names), on ``device``."""

    op: str
    params: dict[str, Any]
    device: str = "cpu"
    seed: int = 0
    index: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FuzzCase:
        return cls(**d)


@dataclass
class CaseResult:
    """What a case gave: ``status`` ``"ok"``, ``"mismatch"`` (a comparison over its tolerance), ``"error"``
    (an exception from a valid call), ``"unclear_error"`` (a bad input without a clear error) or
    ``"illegal_address"`` (a CUDA error that kills the context); ``worst``: the largest error/tolerance ratio."""

    case: FuzzCase
    status: str
    worst: float
    checks: list[tuple[str, float]] = field(default_factory=list)
    message: str = ""
    seconds: float = 0.0
    reused: list[str] = field(default_factory=list)
    """What of this case's graph an earlier case of the same run had too: ``"id"`` (the Python object's id),
    ``"indptr"`` / ``"indices"`` (the tensors' addresses) -- a cache keyed by them would hit stale entries."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def reproduction(self) -> str:
        """A stand-alone Python snippet that re-runs this case alone and prints its result."""
        return reproduction(self.case)

    def summary(self) -> str:
        bad = [f"{n}={r:.3g}" for n, r in self.checks if r > 1.0] + [
            f"{n}=unrepresentable" for n, r in self.checks if math.isnan(r)]
        return (f"case {self.case.index} (seed {self.case.seed}) {self.case.op} on {self.case.device}: {self.status}"
                f" worst {self.worst:.3g} {' '.join(bad)} {self.message}").strip()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["worst"] = _finite(self.worst)
        d["checks"] = [[n, _finite(r)] for n, r in self.checks]
        return d


def _finite(v: float) -> float | str:
    return v if math.isfinite(v) else "unrepresentable" if math.isnan(v) else "inf"


def reproduction(case: FuzzCase) -> str:
    """``python -c`` source re-running ``case`` (its full parameters, not the run's draw) and printing the result."""
    return ("import datapath.testing.fuzz as f; "
            f"r = f.run_case(f.FuzzCase.from_dict({asdict(case)!r})); print(r.summary())")


def _pick(rng: random.Random, options: Iterable[Any], weights: Iterable[float] | None = None) -> Any:
    return rng.choices(list(options), weights=None if weights is None else list(weights))[0]


def _width(rng: random.Random, hi: int = 1024) -> int:
    w = _pick(rng, WIDTHS) if rng.random() < 0.5 else int(2 ** rng.uniform(0, math.log2(hi)))
    return max(1, min(hi, w))


def _dtype(rng: random.Random) -> str:
    return _pick(rng, ("float32", "float16", "bfloat16", "float64"), (50, 20, 20, 10))


def _graph_kind(rng: random.Random, kinds: tuple[str, ...] = GRAPH_KINDS) -> str:
    weights = {"power_law": 25, "uniform": 15, "empty_rows": 8, "one_node": 3, "no_edges": 4, "huge_row": 8,
               "reordered": 8, "block": 20, "bipartite": 9}
    return _pick(rng, kinds, [weights[k] for k in kinds])


def _plan_extra(rng: random.Random, kernel: str) -> dict[str, Any]:
    """Random valid launch overrides of ``kernel``'s plan."""
    extra: dict[str, Any] = {}
    if kernel == "rows":
        if rng.random() < 0.5:
            extra["cut"] = _pick(rng, (1, 4, 8, 32, 128, 512))
        if rng.random() < 0.3:
            extra["row_order"] = "degree"
        elif rng.random() < 0.3:
            extra["rows_per_team"] = _pick(rng, (2, 4, 8, 32))
        if rng.random() < 0.3:
            extra["cf"] = _pick(rng, (1, 2, 4))
        if rng.random() < 0.3:
            extra["sweep"] = "columns"
        if rng.random() < 0.3:
            extra["unroll"] = _pick(rng, (0, 1, 2, 4, 8))
    elif kernel == "groups" and rng.random() < 0.6:
        extra["ngs"] = _pick(rng, (1, 2, 4, 8, 32, 128))
        extra["threads_per_block"] = _pick(rng, (32, 64, 128, 256))
    elif kernel == "tensor_core" and rng.random() < 0.5:
        extra["nt"] = _pick(rng, (1, 2, 4))
    if kernel in ("rows", "groups") and rng.random() < 0.25:
        extra.update(vec=1, dw=_pick(rng, (1, 2, 4, 8, 16, 32)))
    return extra


def _layer_params(rng: random.Random, op: str, p: dict[str, Any], gpu: bool) -> None:
    """A layer's parameters.  Outside the domain where a float64 comparison is well posed: a ReLU between
    16-bit stages (GIN's MLP, the full-graph models: a value near 0 rounds to the other side of the kink and
    its whole gradient term flips), 16-bit sums over 5 layers (overflow), GAT on 16-bit rows long enough
    that the softmax weights are subnormal -- those draw float32 or another graph instead -- and SAGE's
    normalize on narrow rows (a row whose norm is near 0 divides its rounding error by that norm)."""
    hi = 300 if gpu else 64
    half = p["dtype"] in ("float16", "bfloat16")
    p["in"], p["out"] = _width(rng, hi), _width(rng, hi)
    p["graph"] = _graph_kind(rng, SQUARE_KINDS + (("bipartite",) if op in ("sage", "gin", "gat") else ()))
    p["form"] = "pair" if p["graph"] == "bipartite" else _pick(rng, ("x", "pair", "fused"), (60, 20, 20))
    p["table"] = _pick(rng, ("cuda", "unified", "as_unified", "pinned") if gpu else ("cpu", "unified"))
    p["weighted"] = rng.random() < 0.25
    p["bias"] = rng.random() < 0.8
    p["temp_graph"] = _pick(rng, (None, "same", "clone"), (60, 20, 20))  # conv(block.to("cuda"), x): issue 35
    if op == "sage":  # normalize only rows of >= 16 outputs from >= 16 inputs: a row of norm ~0 amplifies errors
        p.update(aggr=_pick(rng, ("mean", "sum", "max")), root=rng.random() < 0.8,
                 normalize=min(p["in"], p["out"]) >= 16 and rng.random() < 0.2)
    elif op == "gcn":
        p.update(normalize=rng.random() < 0.8, loops=rng.random() < 0.4)
        if p["loops"] and p["graph"] == "bipartite":
            p["loops"] = False
    elif op == "gin":
        p.update(aggr=_pick(rng, ("sum", "mean", "max"), (60, 25, 15)), mlp=rng.random() < 0.3 and not half,
                 eps=_pick(rng, (0.0, 0.1, -0.5)), train_eps=rng.random() < 0.4)
    elif op == "gat":
        p["out"] = _width(rng, 64)
        p.update(heads=rng.randint(1, 4), concat=rng.random() < 0.7, bipartite_lin=rng.random() < 0.2,
                 in_dst=_width(rng, hi))
        p["weighted"] = False
        if half and p["graph"] == "huge_row":  # softmax weights of a 100K-edge row are float16 subnormals
            p["graph"] = "power_law"
    else:  # full-graph models: square graphs only
        p["graph"] = _pick(rng, ("uniform", "empty_rows", "reordered", "huge_row", "one_node"), (40, 15, 20, 15, 10))
        p["form"], p["weighted"] = "x", False
        if half:
            p["dtype"] = "float32"
        p.update(hidden=_width(rng, 64), layers=rng.randint(1, 4 if op == "full_gcn" else 5))


def make_case(seed: int, index: int, device: str = "cpu", *, scale: str | None = None,
              ops: tuple[str, ...] | None = None) -> FuzzCase:
    """Case ``index`` of run ``seed``: the op and all its parameters, drawn from (seed, index) alone.

    ``scale``: ``"gpu"`` (the default on CUDA: larger graphs, the 100K-edge row) or ``"cpu"``;
    ``ops``: draw only these (default: every op of `OPS`).
    """
    gpu = torch.device(device).type == "cuda"
    scale = scale or ("gpu" if gpu else "cpu")
    rng = random.Random((int(seed) * 1_000_003 + int(index)) & ((1 << 62) - 1))
    pool = ops or OPS
    op = _pick(rng, pool, [WEIGHTS[OPS.index(o)] for o in pool])
    p: dict[str, Any] = {"seed": rng.getrandbits(40), "graph_seed": rng.getrandbits(40), "scale": scale,
                         "edge_budget": EDGE_BUDGET[scale], "dtype": _dtype(rng),
                         "probe": _pick(rng, ("1", "0"))}
    if op in ("aggregate", "aggregate_fused", "aggregate_transposed", "sddmm", "edge_softmax"):
        p["graph"] = _graph_kind(rng)
        p["width"] = _width(rng, 8 if p["graph"] == "huge_row" and gpu else 1024)
        p["reduce"] = _pick(rng, ("sum", "mean", "max"), (45, 35, 20))
        p["norm"] = p["reduce"] == "sum" and rng.random() < 0.3
        p["weighted"] = rng.random() < 0.35
        p["grad_x"], p["grad_w"], p["w_same"] = rng.random() < 0.9, rng.random() < 0.8, rng.random() < 0.3
    if op == "aggregate":
        if p["weighted"] and rng.random() < 0.2:
            p["heads"] = rng.randint(2, 4)
        p["noncontig"] = rng.random() < 0.1
        p["temp_graph"] = _pick(rng, (None, "same", "clone"), (60, 20, 20))
        p["prepare"] = rng.random() < 0.2
        kernels = ["rows", "groups", "cusparse"] + (["tensor_core"] if p["dtype"] in ("float16", "bfloat16") else [])
        mode = _pick(rng, ("default", "plan", "probe"), (40, 50, 10 if gpu else 0))
        if mode != "default" and p["reduce"] != "max":
            if mode == "probe" and p["width"] * p.get("heads", 1) < 8 and "tensor_core" in kernels:
                kernels.remove("tensor_core")  # the probe offers tensor cores from 8 columns (a ValueError else)
            k = _pick(rng, kernels)
            p["mode"] = f"{mode}:{k}"
            if mode == "plan":
                p["plan_extra"] = _plan_extra(rng, k)
    elif op == "aggregate_fused":
        p["table"] = _pick(rng, ("cuda", "unified", "as_unified", "pinned") if gpu else ("cpu", "unified",
                                                                                        "as_unified"))
        p["extra_rows"] = _pick(rng, (0, 1, 100, 5000))
        p["fused"] = _pick(rng, ("auto", "push", "pull"))
        p["ids32"] = rng.random() < 0.3
    elif op == "aggregate_transposed":
        p["resolved"] = rng.random() < 0.4
    elif op == "sddmm":
        p["op"] = _pick(rng, ("dot", "add", "mul"))
        p["width"] = _width(rng, 128)
        p["heads"] = _pick(rng, (1, 1, 2, 4))
    elif op == "edge_softmax":
        p["heads"] = _pick(rng, (1, 1, 2, 8))
        p["two_d"] = rng.random() < 0.3
        p["spread"] = _pick(rng, (1.0, 10.0, 60.0))
    elif op in ("sage", "gcn", "gin", "gat", "full_gcn", "full_gin"):
        p["op"] = op
        _layer_params(rng, op, p, gpu)
    elif op == "gather":
        _gather_params(rng, p, gpu)
    elif op == "bad_input":
        p["scenario"] = _pick(rng, SCENARIOS)
        p["table"] = _pick(rng, ("cuda", "unified", "pinned") if gpu else ("cpu", "unified"))
    elif op in TYPED_OPS:
        p["op"] = op
        typed_params(rng, op, p, gpu)
    return FuzzCase(op, p, str(device), int(seed), int(index))


def _gather_params(rng: random.Random, p: dict[str, Any], gpu: bool) -> None:
    n_hi, m_hi = (200_000, 60_000) if gpu else (2_000, 2_000)
    p["rows"] = max(1, int(2 ** rng.uniform(0, math.log2(n_hi))))
    p["width"] = _width(rng, 300)
    p["rows"] = max(1, min(p["rows"], (4 << 20) // p["width"]))  # a table of at most 4M values: cheap to make
    p["count"] = int(2 ** rng.uniform(0, math.log2(m_hi))) if rng.random() < 0.95 else 0
    p["dtype"] = _pick(rng, ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8"))
    tables = ("unified", "as_unified", "pinned", "cuda", "cpu") if gpu else ("unified", "as_unified", "cpu")
    p["table"] = _pick(rng, tables)
    unified = p["table"] in ("unified", "as_unified")
    p["path"] = _pick(rng, ("getitem", "gather", "setitem", "scatter") if unified else ("gather", "scatter"))
    p["cuda_idx"] = gpu and (p["table"] != "cpu" or rng.random() < 0.5) and rng.random() < 0.9
    if p["path"] == "scatter" and p["table"] == "cpu":
        p["cuda_idx"] = False
    p["count"] = min(p["count"], p["rows"]) if p["path"] in ("setitem", "scatter") else p["count"]
    p["sort"] = _pick(rng, (None, True, False))
    p["launcher"] = _pick(rng, (None, "native", "driver", "cupy")) if gpu else None
    p["negative"], p["sorted_idx"] = rng.random() < 0.3, rng.random() < 0.3
    p["two_d"], p["idx32"] = rng.random() < 0.2, rng.random() < 0.3
    p["bad"] = _pick(rng, (None, "high", "low"), (88, 8, 4)) if p["count"] else None
    p["sync"] = rng.random() < 0.5 if p["bad"] else None
    if p["bad"] and p["path"] == "getitem" and not p["cuda_idx"]:
        p["bad"] = None  # a CPU tensor indexed on the CPU: PyTorch's own IndexError, nothing of ours


CHECKS: dict[str, Callable[[dict[str, Any], Any, list], None]] = {
    "aggregate": C.check_aggregate, "aggregate_fused": C.check_aggregate_fused,
    "aggregate_transposed": C.check_aggregate_transposed, "sddmm": C.check_sddmm,
    "edge_softmax": C.check_edge_softmax, "sage": C.check_layer, "gcn": C.check_layer, "gin": C.check_layer,
    "gat": C.check_layer, "full_gcn": C.check_layer, "full_gin": C.check_layer, "gather": check_gather,
    "bad_input": check_bad_input, "typed_linear": check_typed_linear, "relations_into": check_relations_into,
    "stacked_mean": check_stacked_mean, "rgcn": check_typed_layer, "rgat": check_typed_layer,
    "hgt": check_typed_layer, "add_self_loops": check_add_self_loops, "typed_bad_input": check_typed_bad_input,
}


def is_illegal(message: str) -> bool:
    """Whether an exception message is a CUDA error that leaves the context unusable."""
    m = message.lower()
    return any(s in m for s in ILLEGAL)


def run_case(case: FuzzCase) -> CaseResult:
    """Run one case (``DATAPATH_OPS_PROBE`` set as the case says for its duration) and grade it."""
    old = os.environ.get("DATAPATH_OPS_PROBE")
    os.environ["DATAPATH_OPS_PROBE"] = case.params.get("probe", "1")
    checks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    status, message = "ok", ""
    try:
        CHECKS[case.op](case.params, case.device, checks)
        if torch.device(case.device).type == "cuda":
            torch.cuda.synchronize()
    except UnclearError as exc:
        status, message = "unclear_error", str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure of a valid call is a finding
        text = f"{type(exc).__name__}: {exc}"
        status = "illegal_address" if is_illegal(text) else "error"
        message = (text[:600] + " | " + " < ".join(
            f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}" for fr in traceback.extract_tb(exc.__traceback__)[-6:]))
    finally:
        if old is None:
            os.environ.pop("DATAPATH_OPS_PROBE", None)
        else:
            os.environ["DATAPATH_OPS_PROBE"] = old
    worst = max((r for _, r in checks if not math.isnan(r)), default=0.0)  # NaN: unrepresentable, not graded
    if status == "ok" and not worst <= 1.0:
        status = "mismatch"
    return CaseResult(case, status, worst, checks, message, time.perf_counter() - t0)


def run_fuzz(seed: int = 0, count: int = 300, device: str = "cpu", *, start: int = 0, scale: str | None = None,
             ops: tuple[str, ...] | None = None, on_result: Callable[[CaseResult], None] | None = None,
             time_limit: float | None = None) -> list[CaseResult]:
    """Cases ``start .. start + count - 1`` of run ``seed`` in one process, freeing tensors between them.

    Stops early after an ``illegal_address`` result (the CUDA context is gone: re-run from the next case in
    a new process) or when ``time_limit`` seconds have passed.  ``on_result`` sees each result as it comes.
    """
    results: list[CaseResult] = []
    seen: dict[str, set[int]] = {"id": set(), "indptr": set(), "indices": set()}
    rng = random.Random(seed)
    t0 = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    for i in range(start, start + count):
        C.LAST_GRAPH.clear()
        res = run_case(make_case(seed, i, device, scale=scale, ops=ops))
        if C.LAST_GRAPH:
            for key, value in zip(("id", "indptr", "indices"), C.LAST_GRAPH):
                if value in seen[key]:
                    res.reused.append(key)
                seen[key].add(value)
        results.append(res)
        if on_result is not None:
            on_result(res)
        if res.status == "illegal_address":
            break
        if rng.random() < 0.05:
            gc.collect()
        if cuda and rng.random() < 0.02:
            torch.cuda.empty_cache()
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
    return results
