"""The fuzz's bad-input cases: each corrupts one argument of a valid call and expects a clear exception.

Clear means: a `ValueError`, `TypeError` or `IndexError` (the project's own errors derive from them) whose
message names the argument, raised before any kernel runs, and a CUDA context that still works afterwards.
A wrong result, a crash, an unrelated message (e.g. a matmul's shape complaint) or no error fail the case.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from datapath import ops
from datapath.graph import CSRGraph
from datapath.testing.fuzz_checks import Checks, _gen, table_for

CLEAR_ERRORS = (ValueError, TypeError, IndexError)


class UnclearError(AssertionError):
    """A bad input that did not raise a clear exception naming the argument."""


def _graph(gen: torch.Generator, device: Any, n: int = 40, e: int = 200) -> CSRGraph:
    dst = torch.randint(0, n, (e,), generator=gen).sort().values
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.bincount(dst, minlength=n).cumsum(0)
    return CSRGraph(indptr.to(device), torch.randint(0, n, (e,), generator=gen).to(device), n, n)


def _x(gen: torch.Generator, n: int, f: int, device: Any) -> torch.Tensor:
    return torch.randn(n, f, generator=gen).to(device)


def _scenarios(gen: torch.Generator, device: Any, table: str) -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (the word the message must contain, the bad call)."""
    from datapath import nn as dnn  # noqa: PLC0415

    g = _graph(gen, device)
    x = _x(gen, 40, 8, device)
    e = g.indices.numel()
    on_gpu = torch.device(device).type == "cuda"
    tab = table_for(_x(gen, 60, 8, "cpu"), table, device)
    ids = torch.randint(0, 60, (40,), generator=gen).to(device)

    def bad_graph(ptr: torch.Tensor | None = None, idx: torch.Tensor | None = None) -> CSRGraph:
        return CSRGraph(g.indptr if ptr is None else ptr, g.indices if idx is None else idx, 40, 40)

    neg_ids, high_ids = ids.clone(), ids.clone()
    neg_ids[3] = -1
    high_ids[5] = 60
    idx_neg, idx_high = g.indices.clone(), g.indices.clone()
    idx_neg[e // 2] = -1
    idx_high[e // 3] = 40
    ptr_dec = g.indptr.clone()
    ptr_dec[20] = ptr_dec[21] + 1
    ptr_end = g.indptr.clone()
    ptr_end[-1] = e - 1
    sage = dnn.SAGEConv(8, 4).to(device)
    s = {
        "src_ids_negative": ("src_ids", lambda: ops.aggregate(g, tab, src_ids=neg_ids)),
        "src_ids_too_high": ("src_ids", lambda: ops.aggregate(g, tab, src_ids=high_ids)),
        "src_ids_wrong_length": ("src_ids", lambda: ops.aggregate(g, tab, src_ids=ids[:-1])),
        "src_ids_float": ("src_ids", lambda: ops.aggregate(g, tab, src_ids=ids.float())),
        "table_noncontiguous": ("contiguous", lambda: ops.aggregate(
            g, table_for(_x(gen, 60, 16, "cpu"), table, device)[:, ::2], src_ids=ids)),
        "x_wrong_rows": ("x", lambda: ops.aggregate(g, x[:-1])),
        "x_int": ("x", lambda: ops.aggregate(g, x.long())),
        "x_1d": ("x", lambda: ops.aggregate(g, x[:, 0])),
        "edge_weight_wrong_length": ("edge_weight", lambda: ops.aggregate(g, x, edge_weight=torch.ones(e + 1,
                                                                                                   device=device))),
        "edge_weight_int": ("edge_weight", lambda: ops.aggregate(g, x, edge_weight=torch.ones(e, dtype=torch.int64,
                                                                                            device=device))),
        "indices_negative": ("indices", lambda: ops.aggregate(bad_graph(idx=idx_neg), x)),
        "indices_too_high": ("indices", lambda: ops.aggregate(bad_graph(idx=idx_high), x)),
        "indptr_decreasing": ("indptr", lambda: ops.aggregate(bad_graph(ptr=ptr_dec), x)),
        "indptr_wrong_end": ("indptr", lambda: ops.aggregate(bad_graph(ptr=ptr_end), x)),
        "indices_float": ("indices", lambda: ops.aggregate(bad_graph(idx=g.indices.float()), x)),
        "reduce_unknown": ("reduce", lambda: ops.aggregate(g, x, "min")),
        "sddmm_b_rows": ("b", lambda: ops.sddmm(g, x, x[:-2])),
        "sddmm_dtypes": ("dtype", lambda: ops.sddmm(g, x, x.double())),
        "edge_softmax_length": ("scores", lambda: ops.edge_softmax(g, torch.randn(e - 1, generator=gen).to(device))),
        "transposed_y_rows": ("y", lambda: ops.aggregate_transposed(g, x[:-1])),
        "sage_x_width": ("x", lambda: sage(g, _x(gen, 40, 7, device))),
        "sage_x_rows": ("x", lambda: sage(g, x[:10])),
        "sage_src_ids_too_high": ("src_ids", lambda: sage(g, tab, src_ids=high_ids)),
    }
    if on_gpu:
        s["edge_weight_on_cpu"] = ("edge_weight", lambda: ops.aggregate(g, x, edge_weight=torch.ones(e)))
        s["x_on_cpu"] = ("cpu", lambda: ops.aggregate(g, x.cpu()))
        s["sage_x_on_cpu"] = ("cpu", lambda: sage(g, x.cpu()))
    return s


SCENARIOS = ("src_ids_negative", "src_ids_too_high", "src_ids_wrong_length", "src_ids_float", "table_noncontiguous",
             "x_wrong_rows", "x_int",
             "x_1d", "edge_weight_wrong_length", "edge_weight_int", "indices_negative", "indices_too_high",
             "indptr_decreasing", "indptr_wrong_end", "indices_float", "reduce_unknown", "sddmm_b_rows",
             "sddmm_dtypes", "edge_softmax_length", "transposed_y_rows", "sage_x_width", "sage_x_rows",
             "sage_src_ids_too_high", "edge_weight_on_cpu", "x_on_cpu", "sage_x_on_cpu")
"""Every bad-input scenario (the last three need CUDA)."""


def check_bad_input(params: dict[str, Any], device: Any, out: Checks) -> None:
    """Run scenario ``params["scenario"]``; raise `UnclearError` unless it raised a clear, named error."""
    gen = _gen(params)
    scen = _scenarios(gen, device, params.get("table", "cuda" if torch.device(device).type == "cuda" else "cpu"))
    name = params["scenario"]
    if name not in scen:  # a GPU scenario on the CPU: nothing to check
        return
    word, call = scen[name]
    expect_clear_error(name, call, CLEAR_ERRORS, word, out, f"the bad {word!r}")


def expect_clear_error(name: str, call: Callable[[], Any], expected: Any, word: str, out: Checks,
                       what: str = "the bad input") -> None:
    """Run ``call``; append ``(name, 0.0)`` to ``out`` if it raised an ``expected`` error naming ``word``, else raise
    `UnclearError` (another error, an error that does not name it, or none: ``what`` was accepted)."""
    try:
        call()
    except expected as exc:
        if word.lower() not in str(exc).lower():
            raise UnclearError(f"{name}: {type(exc).__name__} does not name {word!r}: {str(exc)[:300]}") from exc
        out.append((name, 0.0))
    except Exception as exc:  # noqa: BLE001 - any other exception is not the clear error asked for
        raise UnclearError(f"{name}: {type(exc).__name__} instead of a clear error: {str(exc)[:300]}") from exc
    else:
        raise UnclearError(f"{name}: no exception ({what} was accepted)")
    finally:
        if torch.cuda.is_available():
            torch.ones(4, device="cuda").sum().item()
