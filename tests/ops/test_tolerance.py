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
    # float32 accumulation stays tight on a row of 100K distinct edges; repeated terms add u each (None: all of them)
    assert tolerance(torch.float32, 100_000, repeats=0).atol < 2e-4
    assert tolerance(torch.float32, 100_000).atol == tolerance(torch.float32, 100_000, repeats=100_000).atol
    assert tolerance(torch.float32, 100, repeats=50).atol < tolerance(torch.float32, 100).atol
    assert tolerance(torch.float16, 100, "operand").atol > tolerance(torch.float16, 100).atol
    assert tolerance(torch.float32, 10).atol < tolerance(torch.float32, 1000).atol
    with pytest.raises(ValueError, match="kernel must be one of"):
        tolerance(torch.float32, 1, "magic")
    with pytest.raises(ValueError, match="row_len"):
        tolerance(torch.float32, -1)
    with pytest.raises(ValueError, match="repeats"):
        tolerance(torch.float32, 4, repeats=-1)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_repeated_terms_round_linearly_and_the_repeats_term_covers_them(dtype: torch.dtype) -> None:
    """A source repeated down a column (a hub's ``gy / deg`` added 20,000 times, onto what other rows gave): a
    sequential sum rounds the same way at every addition, far beyond the random walk, within ``u`` per repeat."""
    n, big = 20_000, 2.7
    terms = torch.cat([torch.tensor([big], dtype=torch.float64), torch.full((n,), 0.8 / 97_291, dtype=torch.float64)])
    exact = big + n * (0.8 / 97_291)  # the terms are float64 values: their exact sum, to well under u(float32)
    if dtype == torch.float64:
        from fractions import Fraction

        exact = float(Fraction(big) + n * Fraction(0.8 / 97_291))
    seq = torch.zeros(1, dtype=dtype).index_add(0, torch.zeros(n + 1, dtype=torch.int64), terms.to(dtype))
    ref = torch.tensor([exact], dtype=torch.float64)
    err = max_error(seq, ref)
    assert err > tolerance(dtype, n + 1, repeats=0).atol  # not a random walk: the sqrt(L) rule alone rejects it
    assert_close(seq, ref, tolerance(dtype, n + 1, repeats=n), "repeated terms")


@pytest.mark.parametrize(("dtype", "length"), [(torch.float32, 4_000), (torch.float64, 100_000)])
@pytest.mark.parametrize("duplicates", [False, True])
def test_one_wrong_edge_of_a_long_row_fails_the_rule(dtype: torch.dtype, length: int, duplicates: bool) -> None:
    """A long mean row (distinct sources, or a few sources each repeated ``length / 8`` times, counted as repeats):
    the CPU kernel meets ``tolerance``; the same row with ONE edge reading the wrong source does not."""
    gen = torch.Generator().manual_seed(3)
    sources = 8 if duplicates else length
    x = torch.randn(sources, 6, generator=gen, dtype=torch.float64).to(dtype)
    src = torch.arange(length) % sources
    dst = torch.zeros(length, dtype=torch.int64)
    from datapath.graph import Graph

    g = Graph.from_edge_index(torch.stack([src, dst]), sources)
    good = aggregate(g, x, "mean")
    ref = torch.zeros(sources, 6, dtype=torch.float64)
    ref[0] = x.double().sum(0) * (length // sources) / length if duplicates else x.double().mean(0)
    tol = tolerance(dtype, length, repeats=length if duplicates else 0)
    assert_close(good, ref, tol, "the right row")
    wrong_src = src.clone()
    wrong_src[length // 2] = (wrong_src[length // 2] + 1) % sources  # one edge reads its neighbour's row
    bad = aggregate(Graph.from_edge_index(torch.stack([wrong_src, dst]), sources), x, "mean")
    with pytest.raises(AssertionError, match="element"):
        assert_close(bad, ref, tol, "one wrong edge")
