"""The native launcher: a small C++ extension that checks, allocates and launches a row gather in one call.

A gather from Python spends host time before its kernel reaches the GPU (the output's
allocation, packing the arguments, the driver call through ctypes); a small call from an
idle GPU waits for all of it.  ``native_launch.cpp`` does those steps in one C++ call.  It
is compiled against the running PyTorch by `torch.utils.cpp_extension` (a C++ compiler and
ninja, no CUDA headers) on first use, in a background thread: calls made meanwhile, and
every call where it cannot be built, launch from Python as before.  The build is cached
under ``$DATAPATH_CACHE_DIR`` (default ``~/.cache/datapath``), keyed by the source and the
PyTorch version, so later processes load it in milliseconds.

``gather_config.launcher`` (``DATAPATH_GATHER_LAUNCHER``) other than ``"native"`` leaves it unbuilt and unused.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import os
import platform
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from datapath._runtime.kernels import LaunchError

_SOURCE = "native_launch.cpp"
_lock = threading.Lock()
_done = threading.Event()
_state: dict[str, object] = {"module": None, "status": "not started", "thread": None}


def _cache_root() -> Path:
    root = os.environ.get("DATAPATH_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "datapath"


def _source_text() -> str:
    return importlib.resources.files("datapath._runtime").joinpath(_SOURCE).read_text()


def _build() -> None:
    try:
        from torch.utils import cpp_extension  # noqa: PLC0415 - only when building

        cpp_extension.verify_ninja_availability()
        text = _source_text()
        # one build per source text, PyTorch build, Python ABI and machine
        key = f"{text}\0{torch.__version__}\0{sys.implementation.cache_tag}\0{platform.machine()}"
        tag = hashlib.sha256(key.encode()).hexdigest()[:12]
        name = f"datapath_native_{tag}"
        build_dir = _cache_root() / "native" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        src = build_dir / _SOURCE
        if not src.exists() or src.read_text() != text:  # written whole (another process may be compiling it)
            tmp = build_dir / f".{_SOURCE}.{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, src)
        module = cpp_extension.load(name=name, sources=[str(src)], build_directory=str(build_dir),
                                    extra_cflags=["-O2"], with_cuda=False, verbose=False)
        module.set_launch_error(LaunchError)
        _state["module"], _state["status"] = module, "ready"
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no headers: the Python launch serves
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _state["status"] = f"unavailable: {type(exc).__name__}: {first[:300]}"
    finally:
        _done.set()


def _after_fork_in_child() -> None:
    """A child forked while the parent built has no build thread: it launches from Python (it never waits)."""
    if _state["module"] is None and _state["thread"] is not None and not _done.is_set():
        _state["status"] = "unavailable: this process was forked while its parent built the launcher"
        _done.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def start() -> None:
    """Start building (or loading) the native launcher in a background thread, once per process."""
    if _state["thread"] is not None or _done.is_set():
        return
    with _lock:
        if _state["thread"] is not None or _done.is_set():
            return
        _state["status"] = "building"
        t = threading.Thread(target=_build, name="datapath-native-build", daemon=True)
        _state["thread"] = t
        t.start()


def module(wait: bool = False, timeout: float | None = None) -> ModuleType | None:
    """The native launcher's module, or None while it builds (``wait``: block until it is built or has failed)
    and where it cannot be built."""
    m = _state["module"]
    if m is not None:
        return m  # type: ignore[return-value]
    start()
    if wait:
        _done.wait(timeout)
    return _state["module"]  # type: ignore[return-value]


def status() -> str:
    """``"ready"``, ``"building"``, ``"not started"`` or ``"unavailable: <why>"``."""
    return str(_state["status"])


@dataclass(frozen=True)
class NativeLauncher:
    """Where the native launcher stands in this process.

    Attributes:
        status: ``"ready"``, ``"building"``, ``"not started"`` (no CUDA gather from a host table
            yet) or ``"unavailable: <why>"`` (no C++ compiler, no ninja, no Python headers: the
            launches are made from Python).
        launches: the gathers it has launched so far.
        path: the built extension's file ("" until it is built).
    """

    status: str
    launches: int
    path: str


def native_launcher(wait: bool = False, timeout: float | None = None) -> NativeLauncher:
    """The native launcher's state; ``wait``: start building it and block until it is ready or has failed.

    Without ``wait`` nothing is started: the first CUDA gather from a host table starts the build
    (when ``gather_config.launcher`` is ``"native"``, the default).
    """
    m = module(wait=True, timeout=timeout) if wait else _state["module"]
    if m is None:
        return NativeLauncher(status(), 0, "")
    return NativeLauncher(status(), int(m.launches()), str(getattr(m, "__file__", "")))  # type: ignore[attr-defined]
