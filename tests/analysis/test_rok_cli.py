"""``datapath rok`` user errors: a clear message and a nonzero exit, never a traceback or a silent success."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from datapath.analysis import RokError, sweep
from datapath.cli import main


def test_ssd_path_under_a_regular_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    rc = main(["rok", "--preset", "bert:h=64,l=2,s=32,v=128", "--micro-batches", "1", "--steps", "1",
               "--device", "cpu", "--strategies", "offload-ssd", "--ssd-path", str(f / "sub")])
    out = capsys.readouterr().out
    assert rc != 0
    assert "error:" in out and str(f) in out


def test_every_point_failing_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    from datapath.analysis import cli

    monkeypatch.setattr(cli, "_check_dir_arg", lambda flag, path: None)  # let the sweep itself meet the bad path
    f = tmp_path / "file"
    f.write_text("x")
    rc = main(["rok", "--preset", "bert:h=64,l=2,s=32,v=128", "--micro-batches", "1", "--steps", "1",
               "--device", "cpu", "--strategies", "offload-ssd", "--ssd-path", str(f / "sub")])
    out = capsys.readouterr().out
    assert rc != 0 and "every point failed" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(RokError, match="no CUDA device"):
        sweep("bert:h=64,l=2,s=32,v=128", ["keep"], [1], device="cuda")
    rc = main(["rok", "--preset", "bert:h=64,l=2,s=32,v=128", "--device", "cuda", "--micro-batches", "1"])
    assert rc != 0 and "no CUDA device" in capsys.readouterr().out


def test_old_import_paths_warn_and_work() -> None:
    import importlib
    import sys

    for name, attr in (("rok", "sweep"), ("ssd_plan", "plan"), ("presets", "get_preset")):
        sys.modules.pop(f"datapath.offload.{name}", None)
        mod = importlib.import_module(f"datapath.offload.{name}")
        with pytest.warns(DeprecationWarning, match=f"datapath.analysis.{name}"):
            old = getattr(mod, attr)
        assert old is getattr(importlib.import_module(f"datapath.analysis.{name}"), attr)
    import datapath.offload as off

    with pytest.warns(DeprecationWarning, match="moved to datapath.analysis"):
        assert off.sweep is sweep
