"""How close an aggregation (or a layer built on it) must come to a float64 reference: one rule for every test.

Contract of a `Tolerance` ``(rtol, atol)``: elementwise ::

    |got - ref| <= atol * scale + rtol * |ref|,      scale = max(1, max |ref|)

(`assert_close` checks exactly this; ``torch.testing.assert_close(got, ref, rtol=t.rtol, atol=t.atol * scale)``
is the same check).  The numbers follow from where a kernel rounds, with ``u(dtype)`` the unit roundoff
(half the machine epsilon: 2**-24 float32, 2**-8 bfloat16, 2**-11 float16, 2**-53 float64):

- every kernel rounds its result once to the output dtype: ``rtol = 2 u(out)`` (a factor 2 of margin);
- a sum of ``L`` terms accumulated in dtype ``acc`` rounds at each addition, by at most ``u(acc)`` of the partial
  sum (Higham, *Accuracy and Stability*, 4.2).  Where the terms differ these errors are independent and add as a
  random walk, ``c * u(acc) * sqrt(L)`` of the largest output: our kernels sum a row sequentially in each lane
  (measured 4.2 u sqrt(L) in float32 on an H100, rows of about 4,000 edges): ``c = 8``, as for any float32 /
  float64 accumulation of unknown order.  Where the SAME term is added again and again -- duplicate edges: one
  source repeated down a hub's row, or a hub's ``gy / deg`` repeated down that source's column -- every addition
  rounds the same way and the errors add up linearly, up to ``u(acc)`` of the partial sum each (Higham's
  ``gamma_L`` bound; a float64 ``index_add`` of 1,166 equal terms measured 0.35 u each): ``R`` repeated terms
  add ``R u(acc)``.  So ``atol = 2 u(out) + u(acc) * (4 + 8 sqrt(L) + R)``, with ``R = L`` unless the caller
  counts them (``repeats``: 0 on a graph without duplicate edges).  The float64 reference of the tests must not
  share this error: `datapath.testing.fuzz_reference` sums accurately (a float64 ``index_add`` of the same
  terms would be off by as much as the kernel);
- cuSPARSE's float16 / bfloat16 sums, in the operands' precision, measured 0.1-0.3 u sqrt(L) (H100, rows of 668
  and 4,096 edges): ``u(acc) * (4 + sqrt(L))`` with ``c = 1``, so that its larger error is still bounded tightly;
- ``kernel="operand"``: a float32 sum of terms each rounded to the operands' dtype first (a layer that forms its
  per-edge terms -- GAT's scores, softmax and their gradients -- or a broadcast parameter's products in 16 bits):
  each term is off by up to ``u(op)`` of itself, independently: ``u(op) * (4 + sqrt(L))`` more, plus the
  float32 sum's own bound;
- operands rounded to a narrower dtype before the products (cuSPARSE's matrix values, the tensor-core
  tiles' weights times scales) add ``4 u(operand)``; tf32 rounds the rows too: ``8 u(tf32)``.

Accumulation dtype by kernel: ``rows``, ``groups``, ``push`` and the CPU reference accumulate float16 / bfloat16 /
float32 in float32 (float64 in float64), so their tolerance barely grows with the row length; ``cusparse`` sums in
the operands' own precision (float16 / bfloat16 error grows as ``sqrt(L) u``); ``tensor_core`` multiplies
float16 / bfloat16 (tf32 for float32) operands and accumulates in float32.

Tight enough to catch a wrong edge: one edge of a row read from the wrong source moves that output by
``|x_a - x_b|`` (a mean: over ``L``), against ``u(acc) (4 + 8 sqrt(L))`` of the scale -- in float32 a few
``1e-5`` at ``L = 4,000`` (``tests/ops/test_tolerance.py``).

``depth``: rounding stages chained between the inputs and the result (1 for one op; a layer projects, aggregates,
adds its root term and bias: about 4; attention layers more): the errors of chained stages add, so both numbers
scale with it.

``row_len``: the most terms behind one output element -- a row's edges for the forward, a source's out-degree
for the gradient of x (the transposed rows), and for a layer add the inner width of its matmuls (``in + out``
features) and, for a weight's gradient, the rows summed over.  Overestimating costs only a little tightness
(``sqrt``); underestimating can fail a correct kernel.  ``repeats``: the most of those terms that repeat an
earlier one of the same sum (a row's or a column's edges that duplicate another edge; None: all ``row_len``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["KERNEL_ACCUMULATION", "Tolerance", "assert_close", "max_error", "tolerance", "unit_roundoff"]

KERNEL_ACCUMULATION = {
    None: "float32",
    "rows": "float32",
    "groups": "float32",
    "push": "float32",
    "tensor_core": "float32",
    "cusparse": "operand",
    "reference": "float32",
    "operand": "float32",
}
"""What each kernel accumulates a float16 / bfloat16 sum in ("operand": the inputs' own dtype); float32 and float64
inputs are accumulated in their own dtype by every kernel.  ``"operand"`` as a kernel: a float32 sum of terms
rounded to the inputs' dtype one by one (a layer's 16-bit per-edge terms; see the module docstring)."""

_ROUNDED_OPERANDS = ("cusparse", "tensor_core")


class Tolerance(NamedTuple):
    """``|got - ref| <= atol * max(1, max |ref|) + rtol * |ref|`` elementwise (see the module docstring)."""

    rtol: float
    atol: float


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of a floating ``dtype`` (2**-24 for float32, 2**-8 for bfloat16)."""
    if not dtype.is_floating_point:
        raise ValueError(f"unit_roundoff takes a floating dtype, got {dtype}")
    return torch.finfo(dtype).eps / 2


def _acc_dtype(dtype: torch.dtype, kernel: str | None) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float16, torch.bfloat16) and KERNEL_ACCUMULATION[kernel] == "operand":
        return dtype
    return torch.float32


def tolerance(dtype: torch.dtype, row_len: int = 1, kernel: str | None = None, depth: int = 1,
              repeats: int | None = None) -> Tolerance:
    """The `Tolerance` of ``kernel`` (None: ours, float32 accumulation) on ``dtype`` rows for sums of at most
    ``row_len`` terms, ``repeats`` of them repeated ones, through ``depth`` chained rounding stages.

    Args:
        dtype: the result's (and the inputs') dtype: float16, bfloat16, float32 or float64.
        row_len: the most terms summed into one output element (>= 0; see the module docstring).
        kernel: ``"rows"``, ``"groups"``, ``"push"``, ``"tensor_core"``, ``"cusparse"``, ``"reference"``,
            ``"operand"`` (terms rounded to ``dtype`` one by one, then a float32 sum) or None.
        depth: chained rounding stages (>= 1): 1 for an op, about 4 for a conv layer.
        repeats: the most terms of one sum that repeat another term of it (duplicate edges; >= 0); None: as
            many as ``row_len`` (safe on any graph; 0 on a graph without duplicate edges).
    Returns:
        ``Tolerance(rtol, atol)``, atol in units of ``max(1, max |ref|)``.
    """
    if kernel not in KERNEL_ACCUMULATION:
        raise ValueError(f"kernel must be one of {sorted(k for k in KERNEL_ACCUMULATION if k)} or None, "
                         f"got {kernel!r}")
    if row_len < 0:
        raise ValueError(f"row_len must be >= 0, got {row_len}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if repeats is not None and repeats < 0:
        raise ValueError(f"repeats must be >= 0 or None, got {repeats}")
    rep = row_len if repeats is None else repeats
    u_out = unit_roundoff(dtype)
    acc = _acc_dtype(dtype, kernel)
    u_acc = unit_roundoff(acc)
    if acc in (torch.float16, torch.bfloat16):  # see the module docstring
        atol = 2 * u_out + u_acc * (4 + math.sqrt(row_len))
    else:  # a random walk over distinct terms, linear over repeated ones
        atol = 2 * u_out + u_acc * (4 + 8 * math.sqrt(row_len) + rep)
        if kernel == "operand":  # each term rounded to the inputs' dtype before the float32 sum
            atol += u_out * (4 + math.sqrt(row_len))
    if kernel in _ROUNDED_OPERANDS:  # the matrix values (weight times scales) rounded to the operand dtype
        if kernel == "tensor_core" and dtype == torch.float32:  # tf32 (float16's 10 mantissa bits): x rounded too
            atol += 8 * unit_roundoff(torch.float16)
        else:
            atol += 4 * unit_roundoff(dtype)
    return Tolerance(2 * u_out * depth, atol * depth)


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max(1, max |ref|)`` in float64 on the CPU (inf where ``got`` is not finite)."""
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if g.shape != r.shape:
        raise ValueError(f"got has shape {tuple(g.shape)} but ref {tuple(r.shape)}")
    if g.numel() == 0:
        return 0.0
    if not torch.isfinite(g).all():
        return math.inf
    return float((g - r).abs().max()) / max(1.0, float(r.abs().max()))


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance, what: str = "") -> None:
    """Raise AssertionError unless ``got`` meets ``tol`` against ``ref`` elementwise (any devices and dtypes;
    compared in float64 on the CPU); the message names the worst element and its error."""
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if g.shape != r.shape:
        raise AssertionError(f"{what}: got has shape {tuple(g.shape)} but ref {tuple(r.shape)}")
    if g.numel() == 0:
        return
    if not torch.isfinite(g).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(g)).sum())} non-finite values")
    scale = max(1.0, float(r.abs().max()))
    excess = (g - r).abs() - (tol.atol * scale + tol.rtol * r.abs())
    worst = int(excess.reshape(-1).argmax())
    if float(excess.reshape(-1)[worst]) > 0:
        gv, rv = float(g.reshape(-1)[worst]), float(r.reshape(-1)[worst])
        raise AssertionError(
            f"{what}: element {worst} is {gv:.6g}, the reference {rv:.6g}: error {abs(gv - rv):.3g} > "
            f"{tol.atol:.3g} * {scale:.4g} + {tol.rtol:.3g} * {abs(rv):.4g} (max error {max_error(g, r):.3g} of "
            f"max(1, max |ref|))")
