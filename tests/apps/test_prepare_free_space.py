"""`datapath prepare-dataset --from` (importers) and the heterogeneous presets refuse up front when the disk cannot
hold what they write: one line naming the directory, the bytes needed and free, a non-zero exit, nothing left behind.
The free space is the filesystem's answer to ``os.statvfs``; the tests make that one query report a small number
for the output's filesystem (everything else reads and writes the real disk), and check that the bytes a command
says it needs cover what it writes when there is room."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from datapath.cli import main

N, E, F, C = 2003, 9001, 16, 5


def _report_free(monkeypatch: pytest.MonkeyPatch, under: Path, free: int) -> list[str]:
    """``os.statvfs`` of ``under`` (and of anything below it) says ``free`` bytes are available; the paths asked."""
    real = os.statvfs
    asked: list[str] = []

    def statvfs(path: os.PathLike[str] | str) -> os.statvfs_result:
        st = real(path)
        if not Path(path).absolute().is_relative_to(under):
            return st
        asked.append(str(path))
        fields = list(st)
        fields[4] = free // st.f_frsize  # f_bavail, in blocks of f_frsize
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    return asked


def _refused(capsys: pytest.CaptureFixture[str], code: int, where: Path) -> int:
    """The command's one error line says there is no room in ``where``; the bytes it says it needs."""
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and len(err.splitlines()) == 1, (code, err)
    assert "no room" in err and str(where) in err and "free" in err, err
    return int(re.search(r"needs ([\d,]+) bytes", err).group(1).replace(",", ""))


def _written(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _source(d: Path, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    s = {"edge_index": rng.integers(0, N, (2, E)), "x": rng.standard_normal((N, F)).astype(np.float32),
         "y": rng.integers(0, C, N)}
    masks = {f"{k}_mask": rng.random(N) < p for k, p in (("train", 0.6), ("val", 0.2), ("test", 0.2))}
    np.savez(d / "g.npz", **s, **masks)
    return s


def test_import_refuses_before_writing_when_the_disk_is_too_small(tmp_path, monkeypatch, capsys) -> None:
    _source(tmp_path)
    out = tmp_path / "out" / "ds"
    out.parent.mkdir()
    args = ["prepare-dataset", "--from", "npz", str(tmp_path / "g.npz"), str(out), "--memory", "4GB", "--no-progress"]
    asked = _report_free(monkeypatch, out.parent, 4096)
    needed = _refused(capsys, main(args), out.parent)
    assert asked and not out.exists() and list(out.parent.iterdir()) == []  # nothing written, nothing left
    monkeypatch.undo()
    assert main(args) == 0
    # the bytes it asked for cover the dataset (and the sort's runs, gone once merged), not many times over
    assert _written(out) <= needed <= 2 * _written(out) + (1 << 20), (_written(out), needed)


def test_import_of_a_csv_edge_list_checks_again_once_the_sort_counted_the_nodes(tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """A CSV edge list with CSV node tables: neither the edges nor the nodes are counted before the sort, so the
    node files (here 128 KB of features) are checked once it has counted them, before the first row is written."""
    s = _source(tmp_path, 1)
    np.savetxt(tmp_path / "edges.csv", s["edge_index"].T, fmt="%d", delimiter=",")
    np.savetxt(tmp_path / "x.csv", s["x"], fmt="%.9g", delimiter=",")
    np.savetxt(tmp_path / "y.csv", s["y"], fmt="%d")
    out = tmp_path / "out" / "ds"
    out.parent.mkdir()
    args = ["prepare-dataset", "--from", "csv", str(tmp_path / "edges.csv"), str(out), "--features",
            str(tmp_path / "x.csv"), "--labels", str(tmp_path / "y.csv"), "--no-progress"]
    _report_free(monkeypatch, out.parent, 100 << 10)
    needed = _refused(capsys, main(args), out.parent)
    assert needed >= N * F * 4 and not out.exists() and list(out.parent.iterdir()) == []
    monkeypatch.undo()
    assert main(args) == 0 and (out / "features.npy").is_file()


@pytest.mark.parametrize("preset", ["mag"])
def test_heterogeneous_preset_refuses_before_generating(tmp_path, monkeypatch, capsys, preset) -> None:
    out = tmp_path / "out" / "h"
    args = ["prepare-dataset", preset, str(out), "--device", "cpu", "--no-progress"]
    _report_free(monkeypatch, tmp_path, 1 << 20)
    needed = _refused(capsys, main(args), tmp_path)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert main(args) == 0
    assert _written(out) <= needed <= 2 * _written(out), (_written(out), needed)
