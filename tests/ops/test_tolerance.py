"""The tolerance rule (`datapath.ops.tolerance`): it passes what each accumulation precision gives and fails what a
wrong kernel gives."""
from __future__ import annotations

import pytest
import torch

from datapath.ops import aggregate
from datapath.ops.tolerance import Tolerance, assert_close, max_error, tolerance, unit_roundoff
from datapath.testing import power_law_csr, reference_aggregate


def test_unit_roundoff_and_ordering() -> None:
    assert unit_roundoff(torch.float32) == 2.0**-24 and unit_roundoff(torch.bfloat16) == 2.0**-8
    ours = tolerance(torch.bfloat16, 668)
    lib = tolerance(torch.bfloat16, 668, "cusparse")
    assert lib.atol > 5 * ours.atol  # cuSPARSE sums bfloat16 in bfloat16
    assert tolerance(torch.float32, 100_000).atol < 1e-3  # float32 accumulation stays tight on a row of 100K edges
    assert tolerance(torch.float32, 10).atol < tolerance(torch.float32, 1000).atol
    with pytest.raises(ValueError, match="kernel must be one of"):
        tolerance(torch.float32, 1, "magic")
    with pytest.raises(ValueError, match="row_len"):
        tolerance(torch.float32, -1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float32_accumulation_meets_it_and_operand_accumulation_needs_the_library_rule(dtype: torch.dtype) -> None:
    """Rows of 2,000 random terms: summed in float32 and rounded once they meet ``tolerance(dtype, L)``; summed in
    the operands' own precision (what cuSPARSE does) they need ``kernel="cusparse"``'s, which they meet."""
    gen = torch.Generator().manual_seed(0)
    n = 2000
    terms = torch.randn(64, n, generator=gen).to(dtype)
    ref = terms.double().sum(1)
    ours = terms.float().sum(1).to(dtype)
    assert_close(ours, ref, tolerance(dtype, n), "float32 accumulation")
    if dtype == torch.float32:
        return
    acc = torch.zeros(64, dtype=dtype)
    for k in range(n):  # sequential, rounded at every step
        acc = acc + terms[:, k]
    assert max_error(acc, ref) > tolerance(dtype, n).atol + tolerance(dtype, n).rtol  # ours would reject it
    assert_close(acc, ref, tolerance(dtype, n, "cusparse"), "operand accumulation")


def test_cpu_aggregate_in_float32_meets_the_rule_and_a_wrong_row_fails_it() -> None:
    g = power_law_csr(300, 260, 2500, seed=7)
    x = torch.randn(g.num_src_nodes, 5, generator=torch.Generator().manual_seed(1))
    ref = reference_aggregate(g, x.double(), "mean")
    row_len = int((g.indptr[1:] - g.indptr[:-1]).max())
    out = aggregate(g, x, "mean")
    tol = tolerance(torch.float32, row_len)
    assert_close(out, ref, tol, "cpu mean")
    bad = out.clone()
    bad[7, 2] += 1e-3 * max(1.0, float(ref.abs().max()))  # one element off by a thousandth of the scale
    with pytest.raises(AssertionError, match="element 37"):
        assert_close(bad, ref, tol, "a wrong element")
    assert isinstance(tol, Tolerance) and tol == (tol.rtol, tol.atol)
