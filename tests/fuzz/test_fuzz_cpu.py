"""The differential fuzz in CI: a few hundred random cases of every op and layer against float64 references (CPU;
the same on CUDA where there is a GPU).

Seeded (run 0, cases 0..CASES-1): a failure prints the case and a stand-alone reproduction.  Cases in
`KNOWN` fail for a reason written beside them (a bug being fixed); the test fails when one of them passes
(remove it then) as well as when any other case fails.
"""
from __future__ import annotations

import pytest
import torch

from datapath.testing.fuzz import OPS, CaseResult, FuzzCase, make_case, reproduction, run_case, run_fuzz
from datapath.testing.fuzz_checks import ratio
from datapath.ops.tolerance import tolerance

CASES = 200
KNOWN: dict[int, str] = {}
"""case index -> why it fails now (see /work/notes/issue35.md of the session that found it)."""


@pytest.mark.slow
def test_cpu_fuzz_cases_match_the_reference() -> None:
    results = run_fuzz(seed=0, count=CASES, device="cpu")
    assert len(results) == CASES
    assert {r.case.op for r in results} == set(OPS), "every op is drawn in a run of this length"
    bad = [r for r in results if not r.ok and r.case.index not in KNOWN]
    fixed = [i for i in KNOWN if i < CASES and results[i].ok]
    report = "\n".join(f"{r.summary()}\n  reproduce: python -c \"{r.reproduction()}\"" for r in bad)
    assert not bad, f"{len(bad)} of {CASES} fuzz cases failed:\n{report}"
    assert not fixed, f"cases {fixed} in KNOWN pass now: remove them from KNOWN"


def test_a_case_is_made_from_its_seed_and_index_alone() -> None:
    a, b = make_case(5, 17, "cpu"), make_case(5, 17, "cpu")
    assert a == b
    assert make_case(5, 18, "cpu") != a and make_case(6, 17, "cpu") != a
    ops = {make_case(1, i, "cpu").op for i in range(300)}
    assert ops == set(OPS)


def test_the_reproduction_reruns_the_same_case() -> None:
    case = make_case(0, 3, "cpu", ops=("aggregate",))
    first = run_case(case)
    ns: dict = {}
    code = reproduction(case).replace("print(r.summary())", "")
    exec(code, ns)  # noqa: S102 - the snippet the fuzz prints for a failing case
    again: CaseResult = ns["r"]
    assert again.case == case and again.status == first.status
    assert [n for n, _ in again.checks] == [n for n, _ in first.checks] == ["forward", "grad_x"][: len(first.checks)]
    assert [r for _, r in again.checks] == [r for _, r in first.checks]


def test_a_wrong_result_is_a_mismatch() -> None:
    """The grading can fail: a result off by more than the tolerance, a non-finite or misshapen one."""
    ref = torch.randn(50, 8, dtype=torch.float64)
    t = tolerance(torch.float32, 10)
    assert ratio(ref.float(), ref, t) <= 1.0
    off = ref.clone()
    off[3, 4] += 1e-3 * max(1.0, float(ref.abs().max()))
    assert ratio(off.float(), ref, t) > 1.0
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert ratio(nan, ref, t) == float("inf")
    assert ratio(ref[:-1], ref, t) == float("inf")


def test_a_broken_op_fails_its_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aggregation that drops the last edge of every graph is caught by the fuzz's aggregate cases."""
    from datapath import ops

    real = ops.aggregate

    def broken(graph, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(graph, x, *args, **kwargs)
        return out * (1 + 1e-2)

    monkeypatch.setattr(ops, "aggregate", broken)
    results = [run_case(make_case(2, i, "cpu", ops=("aggregate",))) for i in range(12)]
    assert sum(r.status == "mismatch" for r in results) >= 8


def test_case_results_serialise() -> None:
    r = run_case(make_case(0, 1, "cpu", ops=("gather",)))
    d = r.as_dict()
    assert d["case"]["op"] == "gather" and d["status"] in ("ok", "mismatch", "error", "unclear_error")
    assert FuzzCase.from_dict(d["case"]) == r.case


@pytest.mark.gpu
def test_gpu_fuzz_cases_match_the_reference() -> None:
    """The same on CUDA (the GPU machine's test run; `benchmarks/kernel_fuzz.py` runs >= 10,000 and the sanitizers)."""
    results = run_fuzz(seed=0, count=CASES, device="cuda")
    dead = [r for r in results if r.status == "illegal_address"]
    assert not dead, f"the CUDA context died: {dead[0].summary()}\n  reproduce: python -c \"{dead[0].reproduction()}\""
    bad = [r for r in results if not r.ok]
    report = "\n".join(f"{r.summary()[:400]}\n  reproduce: python -c \"{r.reproduction()}\"" for r in bad[:20])
    assert not bad, f"{len(bad)} of {CASES} GPU fuzz cases failed:\n{report}"
