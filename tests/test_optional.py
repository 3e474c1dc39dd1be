"""Optional dependencies: a missing one fails with one line naming the extra that installs it."""
from __future__ import annotations

import sys

import pytest

from datapath.errors import DatapathError, MissingDependencyError


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look not installed for the rest of the test."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def _sweep_png(tmp_path) -> list[str]:
    return ["ssd-plan", "--preset", "bert-h12288-l3", "--micro-batch", "16", "--tp", "2",
            "--sweep", "micro_batch=8,16", "--png", str(tmp_path / "sweep.png")]


def test_png_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from datapath.cli import main
    _hide(monkeypatch, "matplotlib")
    rc = main(_sweep_png(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and not (tmp_path / "sweep.png").exists()
    assert err[-1] == 'datapath ssd-plan: error: --png needs matplotlib, which is not installed: ' \
                      'pip install "datapath[plot]"', err


def test_from_scipy_without_scipy_names_the_extra(monkeypatch) -> None:
    from datapath.graph import Graph
    _hide(monkeypatch, "scipy")
    with pytest.raises(MissingDependencyError) as info:
        Graph.from_scipy(object())
    assert str(info.value) == 'Graph.from_scipy needs scipy, which is not installed: pip install "datapath[io]"'
    assert isinstance(info.value, ImportError) and isinstance(info.value, DatapathError)


def test_pyg_backend_without_torch_geometric_names_the_extra(monkeypatch) -> None:
    from datapath.nn import GraphSAGE
    _hide(monkeypatch, "torch_geometric")
    with pytest.raises(MissingDependencyError, match=r'pip install "datapath\[pyg\]"'):
        GraphSAGE(8, 16, 3, num_layers=2, backend="pyg")


def test_a_broken_dependency_of_the_package_is_not_blamed_on_the_extra(tmp_path, monkeypatch) -> None:
    """matplotlib is there but one of its own imports fails: that error, not "install the extra"."""
    from datapath.cli import main
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import dp_fake_missing_inner\n")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ModuleNotFoundError) as info:
        main(_sweep_png(tmp_path))
    assert not isinstance(info.value, MissingDependencyError) and info.value.name == "dp_fake_missing_inner"


def test_integrations_import_without_their_trainers(monkeypatch) -> None:
    import datapath.integrations as integ
    assert isinstance(integ.OffloadSession(), integ.OffloadSession)
    with pytest.raises(AttributeError):
        integ.NoSuchCallback  # noqa: B018
    _hide(monkeypatch, "transformers")
    monkeypatch.delitem(sys.modules, "datapath.integrations.hf", raising=False)
    with pytest.raises(MissingDependencyError, match=r'pip install "datapath\[hf\]"'):
        integ.HFOffloadCallback  # noqa: B018
