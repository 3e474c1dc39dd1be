"""The shape of the tree (issue 13's bars): public imports only in tests and benchmarks, layers that import
downward only, no oversized source files, every subpackage exporting its API."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "datapath"
MAX_LINES = 600


def _imports(path: Path) -> list[str]:
    """Every module a file imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _deprecated_alias(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.startswith("Deprecated")


def _private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "datapath" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_tests_benchmarks_and_scripts_import_only_public_names() -> None:
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _files("tests", "benchmarks", "examples", "scripts")
           for m in _imports(p) if _private(m)]
    assert bad == [], "private imports:\n" + "\n".join(bad)


MAX_SCRIPTS = 5


def test_scripts_holds_the_gpu_machine_script_and_few_tools() -> None:
    """One-off probes leave the tree; diagnostics a maintainer runs again are tools under benchmarks/."""
    files = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert "gpu_check.sh" in files
    assert len(files) <= MAX_SCRIPTS, f"scripts/ holds {len(files)} files (at most {MAX_SCRIPTS}): {files}"


def test_the_private_check_would_catch_one(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    private = "datapath.memory." + "_launch"  # spelled in two parts so this file does not name it itself
    f.write_text(f"from {private} import row_layout\nimport datapath.{'_runtime'}\nfrom datapath import memory\n")
    assert [m for m in _imports(f) if _private(m)] == ["datapath.memory._launch", "datapath.memory._launch.row_layout",
                                                       "datapath._runtime"]


@pytest.mark.parametrize("layer, forbidden", [
    ("loaders", ("datapath.nn", "datapath.apps")),
    ("sampling", ("datapath.loaders", "datapath.nn", "datapath.apps", "datapath.features")),
    ("graph", ("datapath.sampling", "datapath.loaders", "datapath.nn", "datapath.ops", "datapath.apps")),
    ("memory", ("datapath.loaders", "datapath.sampling", "datapath.features", "datapath.ops", "datapath.nn",
                "datapath.apps", "datapath.offload")),
    ("ops", ("datapath.loaders", "datapath.nn", "datapath.apps", "datapath.offload")),
    ("offload", ("datapath.loaders", "datapath.nn", "datapath.ops", "datapath.apps", "datapath.analysis")),
    ("features", ("datapath.loaders", "datapath.nn", "datapath.apps")),
])
def test_layers_import_downward_only(layer: str, forbidden: tuple[str, ...]) -> None:
    """Deprecated aliases (a module whose docstring starts with "Deprecated") may forward to a name's new home."""
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in (SRC / layer).rglob("*.py") if not _deprecated_alias(p)
           for m in _imports(p) if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert bad == [], f"{layer} imports a layer above it:\n" + "\n".join(bad)


def test_no_source_file_is_oversized() -> None:
    big = {str(p.relative_to(ROOT)): n for p in _files("src", "benchmarks")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, f"files over {MAX_LINES} lines: {big}"


@pytest.mark.parametrize("package", ["memory", "unified_tensor", "graph", "sampling", "loaders", "features", "ops",
                                     "nn", "offload", "analysis", "apps", "testing", "errors"])
def test_every_package_exports_what_it_lists(package: str) -> None:
    mod = importlib.import_module(f"datapath.{package}")
    names = getattr(mod, "__all__", None)
    assert names, f"datapath.{package} has no __all__"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"datapath.{package}.__all__ lists names it does not define: {missing}"
    assert mod.__doc__ and len(mod.__doc__.strip()) > 40, f"datapath.{package} needs a docstring saying what it is"
