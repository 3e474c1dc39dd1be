"""The offload fuzz (`datapath.testing.fuzz_offload`): random models and configurations give the plain step's losses
and gradients bit for bit, and the fuzz itself catches a corrupted reload."""
from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from datapath.offload.host_store import HostStore
from datapath.testing import OffloadCase, make_offload_case, run_offload_case, run_offload_fuzz
from datapath.testing.fuzz_offload import summary_line


def test_cases_are_reproducible_and_cover_every_configuration() -> None:
    assert make_offload_case(3, 17) == make_offload_case(3, 17)
    cases = [make_offload_case(0, i) for i in range(60)]
    assert {c.config for c in cases} == {"host", "ssd", "tiered", "adaptive", "budget_fast", "budget_slow"}
    assert {c.loop for c in cases} == {"plain", "accumulate", "interleaved", "eval"}
    assert {c.units for c in cases} == {None, "blocks", "leaves"} and any(c.frozen for c in cases)
    files = [c for c in cases if c.config in ("ssd", "tiered")]
    assert {c.fault for c in files} == {"none", "write", "read"} and {c.on_error for c in files} == {"raise", "keep"}
    assert {c.fault for c in cases if c not in files} == {"none"}
    assert {torch.float32, torch.float64, torch.bfloat16} <= {c.dtype for c in cases}
    assert all(c.steps >= 16 for c in cases if c.config.startswith("budget"))
    assert {c.attention for c in cases} == {"none", "saved", "offloaded", "mixed"}
    assert all(c.attention == "none" for c in cases if c.config.startswith("budget") or "checkpoint" in c.features)


@pytest.mark.slow
def test_random_models_and_configurations_are_bit_identical() -> None:
    results = run_offload_fuzz(seed=1, count=14)
    bad = [f"{r.outcome}: {r.detail[:300]}\n{r.reproduction()}" for r in results if not r.ok]
    assert not bad, "\n\n".join(bad)
    assert sum(r.outcome == "identical" for r in results) >= 8  # most cases run to the end, not refused


def _first(config: str, **fields: object) -> OffloadCase:
    case = next(c for c in (make_offload_case(5, i) for i in range(200)) if c.config == config)
    return dataclasses.replace(case, **fields)


def test_the_fuzz_catches_a_corrupted_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _first("host", min_bytes=0, layers=2, steps=2, dtype=torch.float32, batch=2, seq=16, loop="plain")
    assert run_offload_case(case).outcome == "identical"
    read = HostStore.read

    def flip_a_bit(self, slot, dst, *args, **kwargs):  # noqa: ANN001, ANN202 - the store's own signature
        res = read(self, slot, dst, *args, **kwargs)
        flat = dst.view(-1).view(torch.uint8)
        flat[0] ^= 1
        return res

    monkeypatch.setattr(HostStore, "read", flip_a_bit)
    r = run_offload_case(case)
    assert not r.ok and r.outcome == "gradients differ", r


def test_the_fuzz_catches_a_corrupted_attention_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case recomputing its blocks with their attention outputs offloaded is bit-identical; one bit flipped in an
    output fetched back from the attention store is caught."""
    from datapath.offload import attention_offload

    case = _first("host", min_bytes=0, layers=2, steps=2, dtype=torch.float32, batch=2, seq=16, loop="plain",
                  dropout=0.0, attention="offloaded", attention_room=1 << 30)
    r = run_offload_case(case)
    assert r.outcome == "identical" and "attention outputs 0 bytes" not in r.detail, r
    rebuild = attention_offload.rebuild

    def flip_a_bit(data, spec):  # noqa: ANN001, ANN202 - views.rebuild's signature
        data.view(-1)[0] ^= 1
        return rebuild(data, spec)

    monkeypatch.setattr(attention_offload, "rebuild", flip_a_bit)
    r = run_offload_case(case)
    assert not r.ok and r.outcome == "gradients differ", r


def test_an_injected_write_fault_raises_or_is_kept_as_asked() -> None:
    raising = _first("ssd", fault="write", fault_at=0, fault_errno=errno.ENOSPC, on_error="raise", min_bytes=0)
    r = run_offload_case(raising)
    assert r.ok and r.outcome == "raised" and r.detail.startswith(f"{errno.ENOSPC}:"), r
    r = run_offload_case(dataclasses.replace(raising, on_error="keep"))
    assert r.ok and r.outcome == "identical", r


def test_a_fault_on_no_call_the_case_makes_is_reported_as_not_reached() -> None:
    # a fault on the file engine of a cache that has none (host memory): no call, whatever the timing (the drawn
    # cases with none are file cases whose storages all stayed in memory or in the host tier, a matter of timing)
    case = _first("host", fault="write", fault_at=0, on_error="raise", min_bytes=0, steps=2)
    r = run_offload_case(case)
    assert r.ok and r.outcome == "fault not reached", r  # passed, but it tested no fault (was "identical")
    assert r.fault_call is None and r.fault_calls == 0 and "never reached" in r.detail


def test_a_fault_the_case_s_min_bytes_keeps_from_the_files_lands_with_min_bytes_0() -> None:
    case = make_offload_case(11, 33)  # ssd, a write fault, min_bytes 4096: no storage of this model is that large
    assert (case.config, case.fault, case.min_bytes, case.on_error) == ("ssd", "write", 4096, "keep")
    r = run_offload_case(case)
    assert r.ok and r.outcome == "identical", r  # the failed write kept its tensor: bit-identical all the same
    assert r.fault_min_bytes == 0 and r.fault_call == case.fault_at and "min_bytes 0" in r.detail  # was no fault


def test_a_fault_past_the_calls_made_lands_on_one_of_them() -> None:
    at = 1_000_003  # far more calls than any case makes
    case = _first("ssd", fault="write", fault_at=at, fault_errno=errno.ENOSPC, on_error="raise", min_bytes=0)
    r = run_offload_case(case)
    assert r.ok and r.outcome == "raised" and r.detail.startswith(f"{errno.ENOSPC}:"), r  # was "identical"
    assert r.fault_call is not None and r.fault_call < at and r.fault_calls > r.fault_call


def test_the_summary_counts_the_faults_never_reached_apart() -> None:
    assert summary_line(60, 60, 0, 0) == "60 of 60 cases passed"
    assert summary_line(59, 60, 14, 12) == \
        "59 of 60 cases passed (2 with a fault that was never reached; 12 of 14 faults reached)"


@pytest.mark.gpu
def test_random_models_and_configurations_are_bit_identical_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_offload_fuzz(seed=2, count=24, device="cuda")
    bad = [f"{r.outcome}: {r.detail[:300]}\n{r.reproduction()}" for r in results if not r.ok]
    assert not bad, "\n\n".join(bad)
