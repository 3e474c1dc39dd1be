"""The one deprecation mechanism (`datapath._deprecated`): every old path resolves to its new home, with a
DeprecationWarning naming both; no other mechanism (a ``sys.modules`` swap, a hand-written ``__getattr__``)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from datapath import _deprecated as dep  # noqa: PLC2701 - the mechanism itself is what is tested

SRC = Path(__file__).resolve().parents[1] / "src" / "datapath"


def _old_paths() -> list[tuple[str, str]]:
    out = [(m, n) for m, names in dep.MOVED.items() for n in names]
    for m, new in dep.MOVED_MODULES.items():
        out += [(m, n) for n in importlib.import_module(new).__dict__ if not n.startswith("_")][:3]
    return out


@pytest.mark.parametrize("module, name", _old_paths())
def test_every_old_path_warns_and_gives_the_object_at_its_new_home(module: str, name: str) -> None:
    new_module, new_name = dep.target_of(module, name)
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} moved to {new_module}.{new_name}"):
        old = getattr(importlib.import_module(module), name)
    assert old is getattr(importlib.import_module(new_module), new_name)


def test_an_old_name_moved_out_of_a_face_is_not_exported_there_any_more() -> None:
    for module, names in dep.MOVED.items():
        exported = set(getattr(importlib.import_module(module), "__all__", ()))
        assert not exported & set(names), f"{module} exports names it also forwards: {exported & set(names)}"


def test_an_unknown_name_is_an_attribute_error() -> None:
    import datapath.features as features

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        features.no_such_name  # noqa: B018


def test_old_from_imports_work() -> None:
    with pytest.warns(DeprecationWarning, match="datapath.features.scan.GAPS"):
        from datapath.features import GAPS
    from datapath.features.scan import GAPS as new

    assert GAPS is new


def _deprecation_mechanisms(path: Path) -> list[str]:
    """A module-level ``def __getattr__`` that warns of deprecation, and ``sys.modules[...] = ...``, in ``path``
    (a lazy ``__getattr__`` that imports an optional part on first use is no deprecation)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and "Deprecat" in ast.unparse(node):
            found.append(f"{path.name}:{node.lineno} def __getattr__")
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules":
                    found.append(f"{path.name}:{node.lineno} sys.modules swap")
    return found


def test_one_deprecation_mechanism() -> None:
    bad = [m for p in sorted(SRC.rglob("*.py")) for m in _deprecation_mechanisms(p)]
    assert bad == [], "old paths go through datapath._deprecated.forward only:\n" + "\n".join(bad)


def test_the_mechanism_check_would_catch_a_swap(tmp_path: Path) -> None:
    f = tmp_path / "alias.py"
    f.write_text("import sys\nfrom x import y\nsys.modules[__name__] = y\ndef __getattr__(n):\n"
                 "    warnings.warn('moved', DeprecationWarning)\n    return n\n")
    assert [m.split(" ", 1)[1] for m in _deprecation_mechanisms(f)] == ["sys.modules swap", "def __getattr__"]
