"""Private directories: mode 0700, removed at close and at exit, stale ones of dead processes removed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from datapath.offload.spill_dir import SpillDir, clean_stale


def test_private_mode_and_removal(tmp_path: Path) -> None:
    d = SpillDir(tmp_path)
    assert d.path.parent == tmp_path
    assert (os.stat(d.path).st_mode & 0o777) == 0o700
    Path(d.file("x.act")).write_bytes(b"abc")
    d.remove()
    assert not d.path.exists()
    d.remove()  # idempotent


def _child(tmp_path: Path, code: str) -> str:
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(src)}, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.slow
def test_removed_at_interpreter_exit(tmp_path: Path) -> None:
    path = _child(tmp_path, f"""
        from datapath.offload.spill_dir import SpillDir
        d = SpillDir({str(tmp_path)!r})
        open(d.file("a.act"), "wb").write(b"x" * 100)
        print(d.path)
    """)
    assert path and not os.path.exists(path)


@pytest.mark.slow
def test_crashed_process_directory_removed_on_next_start(tmp_path: Path) -> None:
    path = _child(tmp_path, f"""
        import os, torch
        from datapath.offload import TensorCache
        c = TensorCache("ssd", {str(tmp_path)!r}, min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0)
        w = torch.randn(64, 64, requires_grad=True)
        with c:
            y = (w * 2).exp()
            c.wait_io()
        print(c.directory, flush=True)
        assert c.files()
        os._exit(0)  # a crash: no cleanup runs
    """)
    assert os.path.isdir(path) and os.listdir(path)
    alive = tmp_path / f"datapath-offload-{Path(path).name.split('-')[2]}-1-keepme"
    alive.mkdir()  # pid 1 is alive and older than the directory: not stale
    d = SpillDir(tmp_path)
    assert not os.path.exists(path)
    assert Path(path) in d.removed_stale
    assert alive.exists()
    d.remove()
    assert clean_stale(tmp_path) == []
