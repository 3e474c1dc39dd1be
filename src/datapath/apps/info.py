"""``datapath info``: what this machine offers to datapath."""
from __future__ import annotations

import argparse
import json
import resource
from typing import Any

import psutil
import torch

from datapath._runtime import settings
from datapath._runtime.device import _module_version, machine_info
from datapath.memory import native_launcher


def _gds_status() -> dict[str, Any]:
    """Whether kvikio imports and whether it would use GPUDirect Storage (not its compatibility mode)."""
    try:
        import kvikio  # noqa: PLC0415 - optional; needs a CUDA driver even for host buffers
        import kvikio.defaults  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return {"kvikio": None, "gds": False, "why": f"kvikio not importable: {type(exc).__name__}: {exc}"}
    status: dict[str, Any] = {"kvikio": getattr(kvikio, "__version__", "unknown")}
    try:
        compat = kvikio.defaults.is_compat_mode_preferred() if hasattr(kvikio.defaults, "is_compat_mode_preferred") \
            else kvikio.defaults.compat_mode()
        status["gds"] = not bool(compat)
        status["why"] = "compatibility mode (POSIX I/O through host bounce buffers)" if compat else "cuFile GDS"
    except Exception as exc:  # noqa: BLE001
        status.update(gds=False, why=f"kvikio could not tell: {exc}")
    return status


def _pinned_copy_gbps(nbytes: int = 256 << 20) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    for name, fn in (("h2d", lambda: dst.copy_(src, non_blocking=True)),
                     ("d2h", lambda: src.copy_(dst, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        out[f"pinned_{name}_GBps"] = 5 * nbytes / start.elapsed_time(end) / 1e6
    return out


def collect(measure: bool = True) -> dict[str, Any]:
    """Everything ``datapath info`` reports, as a dict."""
    info = dict(machine_info())
    info["kvikio"] = _module_version("kvikio")
    info["gpudirect_storage"] = _gds_status()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    vm = psutil.virtual_memory()
    info["pinned_limits"] = {
        "ulimit_l_soft": "unlimited" if soft == resource.RLIM_INFINITY else soft,
        "ulimit_l_hard": "unlimited" if hard == resource.RLIM_INFINITY else hard,
        "ram_available_bytes": vm.available,
        "note": "CUDA pins through its driver; available RAM is the practical limit",
    }
    if measure and torch.cuda.is_available():
        info["bandwidth"] = _pinned_copy_gbps()
    # built here (tens of seconds, once per machine) where a GPU will use it; else only read
    try:
        launcher = native_launcher(wait=True, timeout=600) if measure and torch.cuda.is_available() \
            else native_launcher()
        info["native_launcher"] = {"status": launcher.status, "path": launcher.path}
    except settings.SettingError as exc:
        info["native_launcher"] = {"status": f"not available ({exc})", "path": None}
    # every DATAPATH_* variable set, and what is wrong with any of them (info runs whatever they say)
    info["settings"] = {"set": settings.current(), "problems": settings.problems()}
    return info


def _print(info: dict[str, Any]) -> None:
    gpu = info.get("gpu")
    print(f"datapath on {info['hostname']}: Python {info['python']}, torch {info['torch']} (CUDA {info['torch_cuda']})")
    print(f"  cupy {info['cupy']}, kvikio {info['kvikio']}, numpy {info['numpy']}")
    print(f"  CPU cores {info['cpu_count']}, RAM {info['ram_bytes'] / 2**30:.1f} GiB")
    if gpu:
        link = f"PCIe gen {gpu.get('pcie_gen_current', '?')}/{gpu.get('pcie_gen_max', '?')} " \
               f"x{gpu.get('pcie_width_current', '?')}/{gpu.get('pcie_width_max', '?')}"
        print(f"  GPU {gpu['name']} (sm {gpu['compute_capability']}, {gpu['multiprocessors']} SMs, "
              f"{gpu['memory_bytes'] / 2**30:.0f} GiB), driver {gpu.get('driver', '?')}, {link} (current/max)")
    else:
        print("  GPU: none (unified tensors are ordinary host memory; every op runs on the CPU)")
    g = info["gpudirect_storage"]
    print(f"  GPUDirect Storage: {'yes' if g.get('gds') else 'no'} ({g.get('why')})")
    p = info["pinned_limits"]
    print(f"  pinned memory: ulimit -l {p['ulimit_l_soft']} (hard {p['ulimit_l_hard']}), "
          f"RAM available {p['ram_available_bytes'] / 2**30:.1f} GiB")
    if "bandwidth" in info:
        b = info["bandwidth"]
        print(f"  pinned copy: host->GPU {b['pinned_h2d_GBps']:.1f} GB/s, GPU->host {b['pinned_d2h_GBps']:.1f} GB/s")
    n = info["native_launcher"]
    print(f"  native launcher (small gathers in one C++ call): {n['status']}{' ' + n['path'] if n['path'] else ''}")
    s = info["settings"]
    shown = ", ".join(f"{k}={v}" for k, v in s["set"].items()) or "none set (defaults)"
    print(f"  settings: {shown}")
    for line in s["problems"]:
        print(f"  bad setting: {line}")


def _cmd(args: argparse.Namespace) -> int:
    info = collect(measure=not args.no_measure)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _print(info)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="versions, GPU and PCIe link, GPUDirect Storage, pinned-memory limits, copy "
                                    "bandwidth, the native launcher (built here on a GPU machine)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the pinned copy bandwidth measurement and the native launcher's build")
    p.set_defaults(func=_cmd)
