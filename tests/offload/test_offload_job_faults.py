"""Any exception in a store or load job ends that transfer as failed, never only logged.

A store job's set-up (the device and its CUDA streams), its write, waiting for its copy and its finishing (the
copy's time, the stored state), and the same steps of a load job, all go to one failure path: a failed store keeps
the tensor in memory, its bytes no longer count as in flight, and the error is raised at the next step, `wait_io`
or `close` (``on_error="raise"``) or logged (``"keep"``); a failed load raises where its tensor is unpacked (or in
the step when autograd has it already).  Before, an exception outside the write was only logged by the worker: the
entry stayed "storing", its bytes counted in flight for good, and with a bound on them the next step waited
forever (here: ``max_inflight_bytes`` of one storage).
"""
from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from datapath.offload import OffloadError, TensorCache
from datapath.offload._workers import Worker
from datapath.offload.store import IOResult
from datapath.offload.transfers import Transfers

TARGETS = ["ssd", "tiered", "host"]
TIER = {"ssd": "ssd", "tiered": "ssd", "host": "host"}  # the store an error names (tiered: its file tier here)
N = 256  # elements of the one offloaded tensor: [256] float64, 2048 bytes


def _cache(tmp_path, target: str, on_error: str, device: torch.device) -> TensorCache:
    """A cache whose in-flight bound is one storage: a store whose bytes stay counted blocks the next pack."""
    opts: dict[str, Any] = dict(min_bytes=0, on_error=on_error, max_inflight_bytes=N * 8, keep_last_modules=0,
                                offload_cpu_tensors=device.type == "cpu")
    if target == "tiered":
        opts["host_budget_bytes"] = 0  # the file tier
    path = str(tmp_path) if target != "host" else None
    cache = TensorCache(target, path, **opts)
    cache.probed_bandwidth(wait=30)  # the probe's transfers are done before a fault is armed
    return cache


def _f(x: torch.Tensor) -> torch.Tensor:
    return (x * 1.5).sin().sum()  # sin saves x * 1.5: the one offloaded storage


def _reference(x: torch.Tensor) -> torch.Tensor:
    """The gradient of `_f` by plain PyTorch (no cache)."""
    x = x.detach().clone().requires_grad_(True)
    _f(x).backward()
    assert x.grad is not None
    return x.grad


def _step(cache: TensorCache, x: torch.Tensor) -> torch.Tensor:
    """One forward and backward of `_f` through ``cache``; the gradient.  The store runs before the backward
    (`wait_io`): the backward reloads the saved tensor from the store (or has it in memory after a failed store)."""
    x.grad = None
    with cache:
        y = _f(x)
        cache.wait_io()
        y.backward()
    assert x.grad is not None
    return x.grad.clone()


def _in_thread(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``fn()`` in a daemon thread: its value, or the exception it raised; a test failure when it hangs."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung: the failed store's bytes still count as in flight (the next pack waits forever)"
    if "error" in out:
        raise out.pop("error")
    return out["value"]


def _fail_once(what: str, when: Callable[..., bool], real: Callable[..., Any]) -> Callable[..., Any]:
    fired = []

    def failing(*args: Any) -> Any:
        if not fired and when(*args):
            fired.append(1)
            raise RuntimeError(f"injected: {what}")
        return real(*args)
    failing.fired = fired  # type: ignore[attr-defined]
    return failing


def _finishing_a_store_fails(monkeypatch: pytest.MonkeyPatch) -> str:
    """The copy's time of the first write (the finishing step, after the bytes were written) raises."""
    what = "reading the store's copy time"
    monkeypatch.setattr(IOResult, "busy_seconds", _fail_once(what, lambda res: res.loc is not None,
                                                              IOResult.busy_seconds))
    return what


def _store_setup_fails(monkeypatch: pytest.MonkeyPatch) -> str:
    """The first job's set-up (on CUDA: the device and its streams; a store job) raises."""
    what = "CUDA error in the store job's set-up"
    monkeypatch.setattr(Transfers, "job_streams", _fail_once(what, lambda *a: True, Transfers.job_streams))
    return what


def _next_steps_are_identical(cache: TensorCache, x: torch.Tensor) -> None:
    """After a failed step (its traceback dropped by the caller): the next two steps store, load and give the
    reference gradients bit for bit."""
    gc.collect()
    grads = _in_thread(lambda: [_step(cache, x) for _ in range(2)])
    for g in grads:
        torch.testing.assert_close(g, _reference(x), rtol=0, atol=0)


def _check_closed(cache: TensorCache, target: str) -> None:
    cache.close()
    gc.collect()
    if target != "host":
        assert not os.path.exists(cache.directory)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", ["finishing", "setup"])
def test_a_store_job_that_raises_fails_the_step_and_the_next_one_runs(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                      target: str, fault: str) -> None:
    cache = _cache(tmp_path, target, "raise", torch.device("cpu"))
    what = (_finishing_a_store_fails if fault == "finishing" else _store_setup_fails)(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(N, dtype=torch.float64, requires_grad=True)
    with pytest.raises(OffloadError) as info:
        _in_thread(lambda: [_step(cache, x) for _ in range(2)])
    msg = str(info.value)
    assert f"to {TIER[target]} failed: RuntimeError: injected: {what}" in msg and "on_error='keep'" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
    assert cache.stats.store_errors == 1
    del info
    _next_steps_are_identical(cache, x)
    st = cache.stats
    assert st.store_errors == 1 and st.storages_offloaded == 3 and st.bytes_loaded == 2 * N * 8
    _check_closed(cache, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", ["finishing", "setup"])
def test_a_store_job_that_raises_keeps_the_tensor_with_keep(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture, target: str,
                                                            fault: str) -> None:
    cache = _cache(tmp_path, target, "keep", torch.device("cpu"))
    what = (_finishing_a_store_fails if fault == "finishing" else _store_setup_fails)(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(N, dtype=torch.float64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="datapath.offload.transfers"):
        grads = _in_thread(lambda: [_step(cache, x) for _ in range(3)])
    for g in grads:
        torch.testing.assert_close(g, _reference(x), rtol=0, atol=0)
    st = cache.stats
    assert st.store_errors == 1 and st.bytes_kept_error == N * 8
    assert st.storages_offloaded == 3 and st.bytes_loaded == 2 * N * 8  # the steps after it store and load
    assert any(f"injected: {what}" in r.getMessage() and "keeping the tensor in memory" in r.getMessage()
               for r in caplog.records)
    _check_closed(cache, target)


def _load_fault(monkeypatch: pytest.MonkeyPatch, fault: str) -> str:
    if fault == "finishing":  # the copy time of the first read (its loc is None: a write's is set)
        what = "reading the load's copy time"
        monkeypatch.setattr(IOResult, "busy_seconds", _fail_once(what, lambda res: res.loc is None,
                                                                  IOResult.busy_seconds))
    else:  # the second job's set-up: the first is the store, the second the load
        what = "CUDA error in the load job's set-up"
        calls = []
        monkeypatch.setattr(Transfers, "job_streams", _fail_once(what, lambda *a: calls.append(1) or len(calls) == 2,
                                                                 Transfers.job_streams))
    return what


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", ["finishing", "setup"])
def test_a_load_job_that_raises_fails_the_step(tmp_path, monkeypatch: pytest.MonkeyPatch, target: str,
                                               fault: str) -> None:
    cache = _cache(tmp_path, target, "keep", torch.device("cpu"))  # "keep" is for stores: a load error raises
    what = _load_fault(monkeypatch, fault)
    torch.manual_seed(0)
    x = torch.randn(N, dtype=torch.float64, requires_grad=True)

    def steps() -> None:
        _step(cache, x)  # raises where x is unpacked, or ...
        cache.wait_io()        # ... here when the backward had x already (the load's finishing raced its unpack)

    with pytest.raises(OffloadError, match=f"loading an activation of {N * 8} bytes from {TIER[target]} failed: "
                                           f"RuntimeError: injected: {what}") as info:
        _in_thread(steps)
    assert cache.stats.load_errors == 1
    del info
    _next_steps_are_identical(cache, x)
    _check_closed(cache, target)


def test_a_worker_hands_a_job_s_exception_to_its_fail_and_runs_on() -> None:
    w = Worker("datapath-test", window=2)
    failed: list[BaseException] = []
    ran: list[int] = []

    def bad() -> None:
        raise ValueError("injected")
    w.submit(bad, fail=failed.append)
    w.submit(lambda: ran.append(1), fail=failed.append)
    assert w.wait_idle(10) and w.idle
    assert [type(e) for e in failed] == [ValueError] and ran == [1]
    w.stop()


# --------------------------------------------------------------------------------------------------- CUDA
def _sync_fails_in(thread_prefix: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``torch.cuda.Event.synchronize`` raises once in a worker thread named ``thread_prefix``...: waiting for a
    job's copy (what a CUDA error does)."""
    what = "CUDA error while waiting for the copy"
    real = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", _fail_once(
        what, lambda *a: threading.current_thread().name.startswith(thread_prefix), real))
    return what


@pytest.mark.gpu
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", ["finishing", "setup", "copy"])
def test_a_store_job_that_raises_fails_the_step_on_cuda(tmp_path, monkeypatch: pytest.MonkeyPatch, cuda_device,
                                                        target: str, fault: str) -> None:
    """On CUDA the finishing runs in the worker once the copy's event completes, and the set-up makes the
    device current and its streams: each failure ends the store as failed, as on the CPU."""
    if fault == "copy" and target != "host":
        pytest.skip("only the host store returns a copy event for the worker to wait for")
    cache = _cache(tmp_path, target, "raise", cuda_device)
    if fault == "copy":
        what = _sync_fails_in(f"datapath-store-{target}", monkeypatch)
    else:
        what = (_finishing_a_store_fails if fault == "finishing" else _store_setup_fails)(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(N, dtype=torch.float64, device=cuda_device, requires_grad=True)
    with pytest.raises(OffloadError, match=f"to {TIER[target]} failed: RuntimeError: injected: {what}") as info:
        _in_thread(lambda: [_step(cache, x) for _ in range(2)])
    assert cache.stats.store_errors == 1
    del info
    _next_steps_are_identical(cache, x)
    _check_closed(cache, target)


@pytest.mark.gpu
def test_a_worker_hands_a_failed_wait_for_a_copy_to_the_job_s_fail(cuda_device) -> None:
    w = Worker("datapath-test-cuda", window=2)
    failed: list[BaseException] = []
    finished: list[int] = []

    def finish() -> None:
        raise ValueError("injected in the finisher")

    def job() -> tuple[Any, Callable[[], None]]:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(cuda_device))
        return ev, finish
    w.submit(job, fail=failed.append)

    def job2() -> tuple[Any, Callable[[], None], Any]:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(cuda_device))
        return ev, lambda: finished.append(1), failed.append
    w.submit(job2, fail=failed.append)
    assert w.wait_idle(10)
    assert [str(e) for e in failed] == ["injected in the finisher"] and finished == [1]
    w.stop()
