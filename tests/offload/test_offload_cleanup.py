"""Nothing left behind: SIGTERM removes the activation files (and chains to the previous handler), a dead
process's directory is reclaimed wherever it was, a disk too small says so, the disk-full message fits the
on_error setting."""
from __future__ import annotations

import copy
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from _offload_models import assert_identical, mlp, run_steps
from datapath.offload import OffloadError, OffloadWarning, SpillDir, TensorCache

SRC = str(Path(__file__).resolve().parents[2] / "src")

CHILD = """
import os, signal, sys, time, torch
from datapath.offload import TensorCache
marker = {marker!r}
def previous(signum, frame):
    open(marker, "w").write("previous handler ran")
    sys.exit(7)
if {install_previous}:
    signal.signal(signal.SIGTERM, previous)
c = TensorCache("ssd", {base!r}, min_bytes=0, offload_cpu_tensors=True, keep_last_modules=0)
w = torch.randn(256, 256, requires_grad=True)
with c:
    y = (w * 2).exp()
    c.wait_io()
    print(c.directory, len(c.files()), flush=True)
    time.sleep(60)
"""


def _start(tmp_path: Path, install_previous: bool) -> tuple[subprocess.Popen, str]:
    code = CHILD.format(marker=str(tmp_path / "marker"), install_previous=install_previous,
                        base=str(tmp_path / "act"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    line = proc.stdout.readline().split()
    assert line, "the child did not start offloading"
    directory, nfiles = line[0], int(line[1])
    assert nfiles > 0 and os.listdir(directory)
    return proc, directory


@pytest.mark.slow
def test_sigterm_removes_the_activation_files(tmp_path: Path) -> None:
    proc, directory = _start(tmp_path, install_previous=False)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == -signal.SIGTERM  # still ends the way SIGTERM ends a process
    assert not os.path.exists(directory)


@pytest.mark.slow
def test_sigterm_chains_to_the_previous_handler(tmp_path: Path) -> None:
    proc, directory = _start(tmp_path, install_previous=True)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == 7 and (tmp_path / "marker").read_text() == "previous handler ran"
    assert not os.path.exists(directory)


@pytest.mark.slow
def test_a_dead_process_directory_is_reclaimed_whatever_its_path(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, torch
        from datapath.offload import TensorCache
        c = TensorCache("ssd", {str(tmp_path / "one")!r}, min_bytes=0, offload_cpu_tensors=True)
        w = torch.randn(64, 64, requires_grad=True)
        with c:
            y = (w * 2).exp()
            c.wait_io()
        print(c.directory, flush=True)
        os._exit(0)  # a crash: no clean-up runs
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": SRC})
    stale = out.stdout.strip()
    assert os.path.isdir(stale) and os.listdir(stale)
    fresh = SpillDir(tmp_path / "two")  # another base path entirely
    assert not os.path.exists(stale)
    assert Path(stale) in fresh.removed_stale
    fresh.remove()


def test_a_disk_too_small_for_any_activation_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp(64, 3)
    batches = [torch.randn(64, 64) for _ in range(2)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    cache = TensorCache("ssd", str(tmp_path), min_bytes=0, offload_cpu_tensors=True, max_disk_bytes=1000)
    cache.attach(model)
    with pytest.warns(OffloadWarning, match="no room in the disk"):
        got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache)
    assert_identical(ref, got)
    assert cache.stats.bytes_offloaded == 0 and cache.stats.bytes_kept_budget > 0
    cache.close()


def _enospc(fd: int, mv: memoryview, off: int) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_messages_fit_on_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(1)
    model = mlp(64, 3)
    batches = [torch.randn(64, 64) for _ in range(2)]
    cache = TensorCache("ssd", str(tmp_path / "a"), min_bytes=0, offload_cpu_tensors=True, on_error="keep")
    cache.file_store.posix.pwrite = _enospc
    cache.attach(model)
    with caplog.at_level(logging.WARNING, logger="datapath.offload"):
        run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache, between=cache.wait_io)
    warned = [r.getMessage() for r in caplog.records if "disk is full" in r.getMessage()]
    assert warned and all("pass on_error='keep'" not in m for m in warned)
    cache.close()

    cache = TensorCache("ssd", str(tmp_path / "b"), min_bytes=0, offload_cpu_tensors=True, on_error="raise")
    cache.file_store.posix.pwrite = _enospc
    cache.attach(model)
    with pytest.raises(OffloadError, match="pass on_error='keep'"):
        run_steps(model, batches, lambda m, x: m(x).pow(2).mean(), ctx=cache, between=cache.wait_io)
    cache.close(raise_errors=False)


def test_sigterm_handler_is_only_installed_from_the_main_thread(tmp_path: Path) -> None:
    """A store made in a worker thread still works (no handler there: signals belong to the main thread)."""
    import threading

    made: list[SpillDir] = []
    t = threading.Thread(target=lambda: made.append(SpillDir(tmp_path)))
    t.start()
    t.join(timeout=30)
    assert made and made[0].path.is_dir()
    made[0].remove()
    time.sleep(0)


@pytest.mark.parametrize("options", ["", "memory_budget='1GB'", "policy='adaptive'"])
def test_a_cache_never_closed_exits_cleanly(options: str) -> None:
    """A script that offloads and never closes its cache ends with its own exit code: the clean-up at exit joins
    the cache's threads before the interpreter shuts down (left running, one inside a torch call made the C++
    runtime abort the process: exit 134, "terminate called without an active exception")."""
    code = textwrap.dedent(f"""
        import sys, torch
        from datapath.offload import TensorCache
        c = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, {options})
        w = torch.randn(64, 64, requires_grad=True)
        with c:
            (w * 2).exp().sum().backward()
        print("trained", flush=True)
        sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert (proc.returncode, proc.stdout.strip()) == (3, "trained"), proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
