"""The per-graph kernel choice: the model's plan, confirmed by a short timing probe where that is cheap.

`choose` returns the plan kept with a view for (width, dtype, variant, weighted, heads), making
it on first use: the model's plan, or, for a graph whose values the ops checked themselves
(not ``trusted``; whole graphs, not sampled blocks) with enough edges, the fastest candidate
of a probe on the call's own input.  cuSPARSE (``torch.sparse.mm``) is a candidate (except in
float16 / bfloat16 on graphs with rows longer than `HALF_LIBRARY_MAX_DEGREE`, where it would
lose precision that our kernels keep), and the probe keeps it unless one of our kernels is
faster by more than `TIE` (so a plan loses to the library by noise at most).  The probe
(`probe`): two warm-up calls per candidate, then
`PROBE_ROUNDS` rounds over the candidates (their order rotated each round), each a batch of
back-to-back calls (about `PROBE_BATCH_MS` of work, after a synchronisation and one untimed call,
between CUDA events: the time per call a training loop sees, launch cost included); a candidate's time is
the median over the rounds.  It synchronises with the host once per batch, once per graph and
key.  Sampled blocks never probe: their plans come from the model alone, so preparing them in
a loader thread never waits for the GPU.  Set ``DATAPATH_OPS_PROBE=0`` to use the model
everywhere.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from datapath._runtime import settings
from datapath._runtime.errors import KernelLoadError
from datapath.ops._graph import CSRView, as_csr
from datapath.ops.plan import AggregationPlan, _next_pow2, plan_for

log = logging.getLogger("datapath.ops.tune")

PROBE_MIN_EDGES = 1 << 14
"""Graphs with fewer edges use the model's plan: their calls cost the launch, whatever the kernel."""
PROBE_ROUNDS = 5
"""Timed rounds per candidate (the median is kept)."""
PROBE_BATCH_MS = 0.5
"""Work per timed batch: the batch repeats a call about this long (at most `PROBE_MAX_CALLS` times)."""
PROBE_MAX_CALLS = 32
TIE = 0.03
"""A kernel of ours replaces cuSPARSE only when its median time is under ``(1 - TIE)`` times cuSPARSE's."""


def plan_key(feat: int, dtype: torch.dtype, variant: str, weighted: bool, heads: int) -> tuple:
    return ("plan", feat, dtype, variant, weighted, heads)


def model_plan(view: CSRView, feat: int, dtype: torch.dtype, heads: int) -> AggregationPlan:
    """`plan_for`'s plan, with several rows per team (at most 8) where rows average at most a quarter of a team's
    lanes of edges and every row is known to be short (at most two teams' lanes: no long row holds a team up), or
    where rows average at most an eighth of a team's lanes whatever their longest.  Measured on products-shaped
    GraphSAGE blocks (`scripts/gpu_block_rows_probe.py`): the input layer at fanout 5 1.02-1.14x faster forward
    (at fanouts 10 and 15 one row per team was faster); the gradient's transposed CSRs (about one edge per source
    row, hubs unbounded) 1.5-2.1x in float32 and 3.7-4x in bfloat16 at 8 rows per team (32 were slower)."""
    p = plan_for(view.num_edges, view.num_dst, feat, dtype.itemsize)
    if heads != 1:
        return p.replace(kernel="groups")
    avg = view.num_edges / max(1, view.num_dst)
    short = view.max_degree is not None and view.max_degree <= 2 * p.dw and avg <= p.dw / 4
    if (short or avg <= p.dw / 8) and view.num_dst < 2**31 and view.num_edges > 0:
        p = p.replace(rows_per_team=min(8, _rows_for_a_team(view, p.dw)))
    return p


def _rows_for_a_team(view: CSRView, dw: int) -> int:
    """Rows (a power of two, at most 32) whose edges on average fill a team's ``dw`` lanes at least."""
    avg = view.num_edges / max(1, view.num_dst)
    return min(32, _next_pow2(math.ceil(dw / max(avg, 1.0))))


HALF_LIBRARY_MAX_DEGREE = 16
"""cuSPARSE (``torch.sparse.mm``) accumulates float16/bfloat16 in the operands' precision: its error grows with
the row length (measured on an H100, 64 columns, against float64: bfloat16 2.5x our kernels' at 64 edges a row,
9x at 4096 (2.9e-2 of max |out|), 20x at 20,000; float16 2.9x at 64, 15x at 4096), where our kernels accumulate
in float32 (their error is the output's rounding at any length).  So for those dtypes the probe offers it only on
graphs whose longest row is at most this many edges (where both round alike); a caller who names it in
``kernels=`` gets it anyway."""


def candidates(view: CSRView, feat: int, dtype: torch.dtype, heads: int, library: bool | None = None
               ) -> list[AggregationPlan]:
    """Every kernel that can run this aggregation: the row split as the model plans it and with rows taken by
    descending length (that one also with a deeper unroll, four vectors per lane on wide rows, a column strip at a
    time on rows of several column chunks, a 4x shorter and a 4x longer cut on long rows and, on rows a team of at
    most 4 lanes covers, 2 and 4 times the lanes with narrower vectors), and, where rows are shorter than a team
    on average, several rows per team; cuSPARSE where it accumulates as precisely as ours (``library``: True /
    False to force it in or out)."""
    from datapath.ops._spmm import tensor_core_ok  # noqa: PLC0415

    model = model_plan(view, feat, dtype, heads)
    if heads != 1:
        return [model]
    base = model.replace(rows_per_team=1)
    by_len = base.replace(row_order="degree")  # measured faster on most of B3's graphs: the variants take it
    out = [base, by_len, by_len.replace(unroll=8 // base.cf)]
    if feat // base.vec > 64:  # wide rows: four vectors per lane, fewer teams per row
        out.append(by_len.replace(cf=4))
    if base.chunks > 1:  # several column chunks a row: a column strip of the table at a time (L2 reuse)
        out += [by_len.replace(sweep="columns"), by_len.replace(sweep="columns", unroll=8 // base.cf)]
    short_cut = max(1, base.cut // 4)
    if view.max_degree is None or view.max_degree > short_cut:  # long rows: shorter and longer pieces
        out += [by_len.replace(cut=short_cut)] + (
            [by_len.replace(cut=4 * base.cut)] if view.max_degree is None or view.max_degree > base.cut else [])
    for k in (2, 4):  # narrow rows (a team of <= 4 lanes): k times the lanes with 1/k-wide vectors, fewer steps a row
        if base.dw <= 4 and base.vec % k == 0:
            out.append(by_len.replace(vec=base.vec // k, dw=base.dw * k))
    if view.num_dst < 2**31:  # short rows on average: several rows a team, loads in flight across row ends
        per_team = _rows_for_a_team(view, base.dw)
        if per_team > 1:
            more = base.replace(rows_per_team=min(32, 4 * per_team))  # measured faster on wide rows
            out += [base.replace(rows_per_team=per_team)] if per_team < more.rows_per_team else []
            out += [more] + ([more.replace(sweep="columns")] if base.chunks > 1 else [])
    if model not in out:
        out.append(model)
    out.append(base.replace(kernel="groups"))
    if library is None:
        library = dtype not in (torch.float16, torch.bfloat16) or (
            view.max_degree is not None and view.max_degree <= HALF_LIBRARY_MAX_DEGREE)
    if library:
        out.append(base.replace(kernel="cusparse"))
    if tensor_core_ok(dtype) and feat >= 8:
        out.append(base.replace(kernel="tensor_core"))
    return out


def may_probe(view: CSRView) -> bool:
    if view.trusted or view.num_edges < PROBE_MIN_EDGES or view.device.type != "cuda":
        return False
    if not settings.get("DATAPATH_OPS_PROBE"):
        return False
    return not torch.cuda.is_current_stream_capturing()


def _batch(run: Callable[[AggregationPlan], Any], p: AggregationPlan, calls: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back ``run(p)`` (the queue drained first)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    run(p)  # untimed lead call: pays for what the previous candidate left in the caches; keeps the GPU busy
    start.record()
    for _ in range(calls):
        run(p)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def pick(cands: list[AggregationPlan], times: list[float]) -> int:
    """The index of the plan to keep: the fastest, unless cuSPARSE is within `TIE` of it (ties go to the library)."""
    best = min(range(len(cands)), key=lambda i: times[i])
    lib = [i for i, p in enumerate(cands) if p.kernel == "cusparse"]
    if lib and cands[best].kernel != "cusparse" and times[best] > (1.0 - TIE) * times[lib[0]]:
        return lib[0]
    return best


def probe(cands: list[AggregationPlan], run: Callable[[AggregationPlan], Any]
          ) -> tuple[AggregationPlan, dict[str, float]]:
    """The candidate `pick` keeps from the median per-call time of ``run(plan)`` (candidates that fail are
    skipped), and every candidate's time in ms."""
    ok: list[AggregationPlan] = []
    calls: list[int] = []
    for p in cands:
        try:
            run(p)  # warm-up: compiles the variant, builds the kernel's schedule
            run(p)
            one = _batch(run, p, 2)
        except (RuntimeError, ValueError, NotImplementedError, KernelLoadError) as exc:
            log.debug("probe: %s failed (%s); skipped", p.kernel, exc)
            continue
        ok.append(p)
        calls.append(max(1, min(PROBE_MAX_CALLS, round(PROBE_BATCH_MS / max(one, 1e-3)))))
    if not ok:
        raise RuntimeError("every aggregation kernel failed in the probe")
    rounds: list[list[float]] = [[] for _ in ok]
    for r in range(PROBE_ROUNDS):
        for k in range(len(ok)):
            i = (k + r) % len(ok)
            rounds[i].append(_batch(run, ok[i], calls[i]))
    times = [statistics.median(t) for t in rounds]
    i = pick(ok, times)
    table = {_label(p): t for p, t in zip(ok, times)}
    log.debug("probe: %s -> %s", table, ok[i].kernel)
    return ok[i].replace(probed_ms=times[i]), table


def _label(p: AggregationPlan) -> str:
    if p.kernel != "rows":
        return p.kernel
    return (f"rows/v{p.vec}/dw{p.dw}/cut{p.cut}/cf{p.cf}/u{p.unroll}" + ("/deg" if p.row_order == "degree" else "")
            + ("/cols" if p.sweep == "columns" else "") + (f"/r{p.rows_per_team}" if p.rows_per_team > 1 else ""))


def choose(view: CSRView, feat: int, dtype: torch.dtype, variant: str, weighted: bool, heads: int,
           run: Callable[[AggregationPlan], Any] | None = None, allow_probe: bool = False,
           kernels: tuple[str, ...] | None = None) -> AggregationPlan:
    """The plan kept with ``view`` for this key; made on first use (probed with ``run`` if ``allow_probe``, among
    ``kernels`` if given)."""
    key = plan_key(feat, dtype, variant, weighted, heads)
    p = view.cache.get(key)
    if p is not None:
        return p
    if run is not None and heads == 1 and allow_probe:
        if view.max_degree is None:  # known degrees spare the row split its tail blocks; a sync is fine here
            view.max_degree = int(view.in_degrees().max()) if view.num_dst else 0
        cands = candidates(view, feat, dtype, heads, library=True if kernels is not None and "cusparse" in kernels
                           else None)
        if kernels is not None:
            cands = [c for c in cands if c.kernel in kernels]
            if not cands:
                raise ValueError(f"none of the kernels {kernels} can run this aggregation ({dtype}, width {feat})")
        with torch.cuda.device(view.device):  # the events and synchronisations on the graph's GPU
            p, view.cache[("probe_ms",) + key] = probe(cands, run)
    else:
        p = model_plan(view, feat, dtype, heads)
    view.cache[key] = p
    return p


def public_call(view: CSRView, x: torch.Tensor, variant: str, w: torch.Tensor | None
                ) -> Callable[[AggregationPlan], Any]:
    """``run(plan)`` for `probe`: the public ``aggregate(view, x, ..., plan=plan)`` call, so that a candidate is
    timed with the per-call host work a user's call has (a kernel that needs more launches than another can be
    host-bound there).  Over a transposed view (the gradient) the ``variant``'s scales are left out: the same
    reads and launches, for timing."""
    from datapath.ops.aggregate import aggregate  # noqa: PLC0415 - aggregate imports the backends

    reduce, norm = ("sum", "gcn") if variant == "gcn" else (variant, None)
    return lambda p: aggregate(view, x, reduce, w, norm, plan=p)


def tune_graph(graph: Any, feat: int, dtype: torch.dtype, reduce: str, norm: str | None,
               weighted: bool, kernels: tuple[str, ...] | None = None) -> AggregationPlan:
    """Probe the kernels for ``graph`` (forward, and backward over its transpose) on random rows."""
    csr = as_csr(graph)
    variant = "gcn" if norm == "gcn" else reduce
    if variant not in ("sum", "mean", "gcn"):
        raise ValueError(f"only sum, mean and gcn aggregations have plans to probe, got reduce={reduce!r}")
    dev = csr.device
    w = torch.rand(csr.num_edges, dtype=dtype, device=dev) if weighted else None
    for view, var, n_in in ((csr, variant, csr.num_src), (csr.transposed(), "sum", csr.num_dst)):
        view.cache.pop(plan_key(feat, dtype, variant, weighted, 1), None)
        x = torch.randn(n_in, feat, device=dev).to(dtype)
        choose(view, feat, dtype, variant, weighted, 1, allow_probe=True, run=public_call(view, x, var, w),
               kernels=kernels)
    return csr.cache[plan_key(feat, dtype, variant, weighted, 1)]
