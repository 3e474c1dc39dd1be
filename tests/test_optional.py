"""Optional dependencies: a missing one fails with one line naming the extra that installs it."""
from __future__ import annotations

import sys

import pytest

from datapath.errors import DatapathError, MissingDependencyError


def _require():  # the helper lives in the private runtime; this is the one test of it
    from datapath._runtime.optional import require
    return require


def test_present_module_is_returned() -> None:
    import json
    assert _require()("json", extra="none") is json


def test_missing_module_names_the_extra() -> None:
    with pytest.raises(MissingDependencyError) as info:
        _require()("datapath_no_such_pkg.sub", extra="plot", purpose="--png")
    msg = str(info.value)
    assert msg == '--png needs datapath_no_such_pkg, which is not installed: pip install "datapath[plot]"'
    assert "\n" not in msg
    assert isinstance(info.value, ImportError) and isinstance(info.value, DatapathError)


def test_a_broken_dependency_of_the_package_is_not_blamed_on_the_extra(tmp_path, monkeypatch) -> None:
    (tmp_path / "dp_fake_pkg").mkdir()
    (tmp_path / "dp_fake_pkg" / "__init__.py").write_text("import dp_fake_missing_inner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        _require()("dp_fake_pkg", extra="plot")
    assert not isinstance(info.value, MissingDependencyError) and info.value.name == "dp_fake_missing_inner"


def test_png_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from datapath.cli import main
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "not installed"
    rc = main(["ssd-plan", "--preset", "bert-h12288-l3", "--micro-batch", "16", "--tp", "2",
               "--sweep", "micro_batch=8,16", "--png", str(tmp_path / "sweep.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and not (tmp_path / "sweep.png").exists()
    assert err[-1].endswith('needs matplotlib, which is not installed: pip install "datapath[plot]"'), err


def test_integrations_import_without_their_trainers() -> None:
    import datapath.integrations as integ
    assert integ.OffloadSession is not None
    with pytest.raises(AttributeError):
        integ.NoSuchCallback  # noqa: B018
