"""One training step under `torch.profiler`: where its GPU time went and how long its CPU waited for the GPU.

`traced_step(step)` runs ``step()`` once under the profiler and returns, in milliseconds:
``wall_ms`` (the step, profiler overhead included), ``gpu_compute_ms`` / ``gpu_nccl_ms`` / ``gpu_copy_ms`` (the
summed durations of the compute kernels, of NCCL's kernels, of host<->device copies), ``gpu_busy_ms`` (the union
of every kernel's and copy's interval: time the GPU did anything), ``nccl_alone_ms`` (time NCCL ran with no compute
kernel beside it: communication the step did not hide) and ``cpu_sync_ms`` (host time in CUDA synchronisation
calls: where the CPU could not run ahead to queue work such as FSDP2's next all-gather), ``gpu_idle_ms`` (the step's
span less ``gpu_busy_ms``), ``alloc_retries`` (times the caching allocator freed its cache and retried: a full
device), ``cuda_api_ms`` (host time per CUDA allocation and synchronisation call) and ``top_kernels`` (the longest
kernels by summed time).  With ``trace`` set, the Chrome trace is written there too.  A diagnostic for the GPU machine (B6 ``--trace``), not a measure of speed.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
_API = _SYNC + ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister", "cuMemCreate",
                "cuMemMap", "cuMemUnmap", "cuMemRelease", "cuMemSetAccess")
TOP_KERNELS = 8


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(intervals))


def _minus(base: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of ``base`` not covered by the union of ``cover``."""
    merged = _merged(cover)
    total = 0.0
    for a, b in _merged(base):
        for c, d in merged:  # subtract every covering interval that meets [a, b]
            if d <= a or c >= b:
                continue
            if c > a:
                total += c - a
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            total += b - a
    return total


def traced_step(step: Callable[[], None], trace: str | Path | None = None) -> dict[str, Any]:
    """Run ``step()`` once under the profiler (CUDA); the summary described in the module docstring."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    retries0 = 0
    if cuda:
        torch.cuda.synchronize()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    compute: list[tuple[float, float]] = []
    nccl: list[tuple[float, float]] = []
    copy: list[tuple[float, float]] = []
    sync_us = 0.0
    api_us: dict[str, float] = {}
    kernel_us: dict[str, float] = {}
    start, end = float("inf"), float("-inf")
    for e in prof.events():
        t0, dt = e.time_range.start, e.time_range.elapsed_us()
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.lower()
            iv = (t0, t0 + dt)
            (copy if "memcpy" in name or "memset" in name else nccl if "nccl" in name else compute).append(iv)
            kernel_us[e.name[:80]] = kernel_us.get(e.name[:80], 0.0) + dt
        elif e.name in _API:
            api_us[e.name] = api_us.get(e.name, 0.0) + dt
            sync_us += dt if e.name in _SYNC else 0.0
        start, end = min(start, t0), max(end, t0 + dt)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0 if cuda else 0
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    ms = 1e-3
    return {"wall_ms": (end - start) * ms if end > start else 0.0,
            "gpu_compute_ms": sum(b - a for a, b in compute) * ms, "gpu_nccl_ms": sum(b - a for a, b in nccl) * ms,
            "gpu_copy_ms": sum(b - a for a, b in copy) * ms, "gpu_busy_ms": _union(compute + nccl + copy) * ms,
            "nccl_alone_ms": _minus(nccl, compute) * ms, "cpu_sync_ms": sync_us * ms,
            "gpu_idle_ms": max(0.0, (end - start) - _union(compute + nccl + copy)) * ms if end > start else 0.0,
            "alloc_retries": retries, "cuda_api_ms": {k: v * ms for k, v in sorted(api_us.items())},
            "top_kernels": [[k, v * ms] for k, v in sorted(kernel_us.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]]}
