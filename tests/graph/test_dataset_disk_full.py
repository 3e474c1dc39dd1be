"""`datapath prepare-dataset` on a full disk, under a file-size limit, and stopped by SIGINT/SIGTERM: one line
naming the directory (or file), the bytes needed and free; a non-zero exit; no temporary folder left; the dataset
that was there before intact."""
from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from datapath.graph import Dataset, Graph, load_dataset

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cli(*args: str, preexec_fn=None) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "datapath.cli", *args], capture_output=True, text=True, env=env,
                          preexec_fn=preexec_fn, timeout=300)


def _popen(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "datapath.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _small_dataset(directory: Path, seed: int = 0) -> dict[str, str]:
    """A 300-node random dataset saved in ``directory``; the digest of each of its files."""
    g = torch.Generator().manual_seed(seed)
    n, e = 300, 1500
    src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    graph = Graph.from_edge_index(torch.stack([src, dst]), n)
    ids = torch.randperm(n, generator=g)
    ds = Dataset("small", graph, torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g),
                 ids[:200].sort().values, ids[200:250].sort().values, ids[250:].sort().values, 3)
    ds.save(directory)
    return _digests(directory)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # noqa: ANN201
    """A 6 MiB tmpfs (the tiny preset needs about 7 MB); skipped where mounting is not permitted."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_says_so_and_keeps_the_old_dataset(tiny_tmpfs: Path) -> None:
    target = tiny_tmpfs / "ds"
    before = _small_dataset(target)
    r = _cli("prepare-dataset", "tiny", str(target), "--overwrite", "--no-progress", "--device", "cpu")
    line = _one_line(r.stderr)
    assert r.returncode in (1, 2), (r.returncode, r.stderr)
    assert "no room" in line and str(tiny_tmpfs) in line and "bytes" in line and "free" in line, line
    assert _digests(target) == before
    assert not _leftovers(tiny_tmpfs)
    load_dataset(target)


@pytest.mark.slow
def test_file_size_limit_names_the_file(tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes then fail with EFBIG instead of killing

    target = tmp_path / "ds"
    before = _small_dataset(target)
    r = _cli("prepare-dataset", "tiny", str(target), "--overwrite", "--no-progress", "--device", "cpu",
             preexec_fn=limit)
    line = _one_line(r.stderr)
    assert r.returncode in (1, 2), (r.returncode, r.stderr)
    assert "ulimit -f" in line and str(target / "features.npy") in line and "bytes" in line, line
    assert _digests(target) == before
    assert not _leftovers(tmp_path)


def _stop_while_generating(tmp_path: Path, sig: int) -> tuple[subprocess.Popen[str], float, str]:
    """Start prepare-dataset reddit, send ``sig`` once it writes; the process, the seconds from the signal to
    its one-line message, and its stderr."""
    target = tmp_path / "ds"
    p = _popen("prepare-dataset", "reddit", str(target), "--overwrite", "--no-progress", "--device", "cpu")
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in p.stderr))  # type: ignore
    reader.start()
    deadline = time.time() + 120
    while not _leftovers(tmp_path):  # the temporary folder appears once generation starts
        assert p.poll() is None and time.time() < deadline, lines
        time.sleep(0.02)
    time.sleep(1.0)
    sent = time.time()
    p.send_signal(sig)
    p.wait(timeout=60)
    reader.join()
    return p, (lines[0][0] - sent if lines else float("inf")), "".join(ln for _, ln in lines)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_generation_within_a_second_and_removes_the_temporary_folder(
        tmp_path: Path, sig: int, code: int) -> None:
    before = _small_dataset(tmp_path / "ds")
    p, took, err = _stop_while_generating(tmp_path, sig)
    assert p.returncode == code, (p.returncode, err[-3000:])
    _one_line(err)
    # 1 s on an idle machine; the slack is for a CI machine shared with other jobs
    assert took < 3.0, f"{took:.2f} s from the signal to the message"
    assert not _leftovers(tmp_path)
    assert _digests(tmp_path / "ds") == before
