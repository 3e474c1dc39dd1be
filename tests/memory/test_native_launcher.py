"""The native launcher builds against the installed PyTorch (a C++ compiler and ninja) and says where it stands."""
from __future__ import annotations

import shutil

import pytest

from datapath.memory import NativeLauncher, native_launcher


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_native_launcher_builds_against_this_pytorch(tmp_path_factory: pytest.TempPathFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ninja", reason="the build needs ninja (pip install ninja)")
    info = native_launcher(wait=True, timeout=600)
    assert isinstance(info, NativeLauncher)
    assert info.status == "ready", info.status  # a C++ error against this PyTorch's headers lands here
    assert info.path.endswith(".so") and info.launches >= 0
    again = native_launcher()  # no wait: the same module
    assert again.status == "ready" and again.path == info.path


def test_the_state_reads_without_starting_a_build() -> None:
    info = native_launcher()
    assert info.status in ("ready", "building", "not started") or info.status.startswith("unavailable: ")
