"""The native launcher builds against the installed PyTorch (a C++ compiler and ninja) and says where it stands;
a builder that dies never blocks the next one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from datapath.memory import NativeLauncher, native_launcher

needs_toolchain = pytest.mark.skipif(
    (shutil.which("c++") is None and shutil.which("g++") is None) or shutil.which("ninja") is None
    and not Path(sys.executable).with_name("ninja").exists(),
    reason="the build needs a C++ compiler and ninja (pip install ninja)")


@needs_toolchain
def test_the_native_launcher_builds_against_this_pytorch() -> None:
    info = native_launcher(wait=True, timeout=600)
    assert isinstance(info, NativeLauncher)
    assert info.status == "ready", info.status  # a C++ error against this PyTorch's headers lands here
    assert info.path.endswith(".so") and Path(info.path).exists() and info.launches >= 0
    again = native_launcher()  # no wait: the same module
    assert again.status == "ready" and again.path == info.path


def test_the_state_reads_without_starting_a_build() -> None:
    info = native_launcher()
    assert info.status in ("ready", "building", "not started") or info.status.startswith("unavailable: ")


def _run(code: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          check=True)
    return done.stdout.split()


@needs_toolchain
@pytest.mark.slow
def test_a_builder_that_exits_or_dies_mid_build_blocks_no_one(tmp_path: Path) -> None:
    env = {**os.environ, "DATAPATH_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    start = "from datapath.memory import native_launcher as n; print(n(wait=True, timeout=0.5).status)"
    assert _run(start, env) == ["building"]  # this process exits while its build runs
    wait = "from datapath.memory import native_launcher as n; i = n(wait=True, timeout=500); print(i.status, i.path)"
    status, path = _run(wait, env)
    assert status == "ready" and Path(path).exists()
    # a builder killed hard: PyTorch's lock file left behind, no finished build
    folder = Path(path).parent
    (folder / "built").unlink()
    Path(path).unlink()
    (folder / "lock").write_text("")
    status, again = _run(wait, env)
    assert status == "ready" and again == path and Path(path).exists() and not (folder / "lock").exists()
