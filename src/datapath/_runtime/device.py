"""Device detection and the machine description written into every benchmark result."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

import torch

from datapath._runtime.errors import CudaUnavailableError


def cuda_available() -> bool:
    """True when PyTorch sees at least one CUDA device."""
    return torch.cuda.is_available()


def require_cuda(what: str) -> torch.device:
    """Return the current CUDA device, or raise `CudaUnavailableError` naming ``what``."""
    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"{what} needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Use the CPU path or run on a GPU machine."
        )
    return torch.device("cuda", torch.cuda.current_device())


def _nvidia_smi_query(fields: str) -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return [x.strip() for x in out[0].split(",")] if out else None


def _module_version(name: str) -> str | None:
    try:
        mod = __import__(name)
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    return getattr(mod, "__version__", "unknown")


@functools.lru_cache(maxsize=1)
def machine_info() -> dict[str, Any]:
    """A JSON-able description of this machine: host, CPU, RAM, Python, torch, CUDA, GPU, PCIe link.

    Every benchmark result carries it so that a number is never separated from
    the hardware it was taken on.
    """
    import psutil

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": _module_version("cupy"),
        "numpy": _module_version("numpy"),
        "gpu": None,
    }
    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        gpu: dict[str, Any] = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory,
        }
        q = _nvidia_smi_query(
            "driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
        )
        if q is not None and len(q) == 5:
            gpu.update(
                driver=q[0], pcie_gen_current=q[1], pcie_gen_max=q[2],
                pcie_width_current=q[3], pcie_width_max=q[4],
            )
        info["gpu"] = gpu
    return info


def device_label() -> str:
    """A short label such as ``'NVIDIA H200'`` or ``'cpu'`` for tables and plot titles."""
    gpu = machine_info()["gpu"]
    return gpu["name"] if gpu else "cpu"
