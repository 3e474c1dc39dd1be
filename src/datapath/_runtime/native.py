"""The native launcher: a small C++ extension that checks, allocates and launches a row gather in one call.

A gather from Python spends host time before its kernel reaches the GPU (the output's
allocation, packing the arguments, the driver call through ctypes); a small call from an
idle GPU waits for all of it.  ``native_launch.cpp`` does those steps in one C++ call.  It
is compiled against the running PyTorch by `torch.utils.cpp_extension` (a C++ compiler and
ninja, no CUDA headers) on first use: calls made meanwhile, and every call where it cannot be
built, launch from Python as before.  The build is cached under ``$DATAPATH_CACHE_DIR``
(default ``~/.cache/datapath``), one per source, PyTorch build, Python ABI and machine; a
later process finds it complete (a marker written after the build) and loads it in
milliseconds.

The compiler runs in a child process of its own session (``python -m
datapath._runtime.native_build``) that a background thread waits for: a process that exits or is
killed mid-build leaves no half-built state behind (the child finishes, and holds an
``flock`` on the build folder that the system releases whatever happens, so concurrent
processes build once and a dead builder never blocks the next).

``gather_config.launcher`` (``DATAPATH_GATHER_LAUNCHER``) other than ``"native"`` leaves it unbuilt and unused.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from datapath._runtime import settings
from datapath._runtime.kernels import LaunchError

SOURCE = "native_launch.cpp"
DONE_MARK = "built"  # written into the build folder once the extension is complete (`native_build`)
_lock = threading.Lock()
_done = threading.Event()
_state: dict[str, object] = {"module": None, "status": "not started", "thread": None}


def _cache_root() -> Path:
    root = settings.get("DATAPATH_CACHE_DIR")
    return root if root is not None else Path.home() / ".cache" / "datapath"


def source_text() -> str:
    """The extension's C++ source, as shipped in the package."""
    return importlib.resources.files("datapath._runtime").joinpath(SOURCE).read_text()


def _name_and_dir() -> tuple[str, Path]:
    """The extension's module name and build folder: one per source text, PyTorch build, Python ABI and machine."""
    key = f"{source_text()}\0{torch.__version__}\0{sys.implementation.cache_tag}\0{platform.machine()}"
    name = f"datapath_native_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return name, _cache_root() / "native" / name


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> None:
    try:
        name, build_dir = _name_and_dir()
        mark = build_dir / DONE_MARK
        path = Path(mark.read_text().strip()) if mark.exists() else None
        if path is None or not path.exists():
            # this process's modules, and the tools installed beside its Python (pip's ninja) even if not on PATH
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                       PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))))
            child = subprocess.run([sys.executable, "-m", "datapath._runtime.native_build", name, str(build_dir)],
                                   capture_output=True, text=True, start_new_session=True, check=False, env=env)
            if child.returncode != 0 or not mark.exists():
                lines = (child.stderr or child.stdout or "").strip().splitlines()
                raise RuntimeError(lines[-1] if lines else f"the build exited with status {child.returncode}")
            path = Path(mark.read_text().strip())
        module = _load(name, path)
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

