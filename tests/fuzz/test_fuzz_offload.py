"""The offload fuzz (`datapath.testing.fuzz_offload`): random models and configurations give the plain step's losses
and gradients bit for bit, and the fuzz itself catches a corrupted reload."""
from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from datapath.offload.host_store import HostStore
from datapath.testing import OffloadCase, make_offload_case, run_offload_case, run_offload_fuzz


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


def test_an_injected_write_fault_raises_or_is_kept_as_asked() -> None:
    raising = _first("ssd", fault="write", fault_at=0, fault_errno=errno.ENOSPC, on_error="raise", min_bytes=0)
    r = run_offload_case(raising)
    assert r.ok and r.outcome == "raised" and r.detail.startswith(f"{errno.ENOSPC}:"), r
    r = run_offload_case(dataclasses.replace(raising, on_error="keep"))
    assert r.ok and r.outcome == "identical", r


@pytest.mark.gpu
def test_random_models_and_configurations_are_bit_identical_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_offload_fuzz(seed=2, count=24, device="cuda")
    bad = [f"{r.outcome}: {r.detail[:300]}\n{r.reproduction()}" for r in results if not r.ok]
    assert not bad, "\n\n".join(bad)
