"""The shape of the tree (issue 13's bars): public imports only in tests and benchmarks, layers that import
downward only, no oversized source files, every subpackage exporting its API."""
from __future__ import annotations

import ast
import fnmatch
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


# (file, private module) pairs allowed: the test of a private mechanism itself
ALLOWED_PRIVATE = {("tests/test_deprecated.py", "datapath._deprecated"),
                   ("tests/offload/test_offload_job_faults.py", "datapath.offload._workers"),
                   ("tests/offload/test_offload_job_faults.py", "datapath.offload._workers.Worker")}


def test_tests_benchmarks_and_scripts_import_only_public_names() -> None:
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _files("tests", "benchmarks", "examples", "scripts")
           for m in _imports(p) if _private(m) and (str(p.relative_to(ROOT)), m) not in ALLOWED_PRIVATE]
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
                "datapath.apps", "datapath.offload", "datapath.unified_tensor")),
    ("ops", ("datapath.loaders", "datapath.nn", "datapath.apps", "datapath.offload")),
    ("offload", ("datapath.loaders", "datapath.nn", "datapath.ops", "datapath.apps", "datapath.analysis",
                 "datapath.integrations")),
    ("integrations", ("datapath.loaders", "datapath.nn", "datapath.ops", "datapath.apps", "datapath.graph")),
    ("features", ("datapath.loaders", "datapath.nn", "datapath.apps")),
])
def test_layers_import_downward_only(layer: str, forbidden: tuple[str, ...]) -> None:
    """Deprecated aliases (a module whose docstring starts with "Deprecated") may forward to a name's new home."""
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in (SRC / layer).rglob("*.py") if not _deprecated_alias(p)
           for m in _imports(p) if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert bad == [], f"{layer} imports a layer above it:\n" + "\n".join(bad)


# --- the import graph of src/: package to package, and module to module ------------------------------------------

# What each package may import (the packages right below it; the test takes the closure).  DESIGN.md's flow:
# apps -> loaders -> sampling/features -> memory -> _runtime, nn -> ops -> memory, offload -> _runtime.
# Every package may import `_runtime`, `errors` and `_deprecated` (old names forwarded by string, imports nothing).
BELOW: dict[str, tuple[str, ...]] = {
    "_runtime": (),
    "_deprecated": (),
    "errors": ("_runtime",),
    "kernels": ("_runtime",),
    "memory": ("kernels",),
    "unified_tensor": ("memory",),
    "graph": ("memory",),
    "sampling": ("graph",),
    "features": ("sampling", "unified_tensor"),
    "ops": ("graph",),
    "nn": ("ops",),
    "loaders": ("features",),
    "offload": (),
    "analysis": ("offload",),
    "integrations": ("offload",),
    "testing": ("loaders", "nn", "offload"),  # fuzzers of both sides: the kernels and offloading
    "apps": ("loaders", "nn"),
    "<root>": ("apps", "analysis", "integrations", "testing"),
    "cli": ("<root>",),  # the `datapath` command: above everything
}
BASE = ("_runtime", "errors", "_deprecated")


def _module_graph() -> dict[str, set[str]]:
    """Module -> the datapath modules it imports (module level and inside functions; ``from a import b`` gives
    ``a.b`` where that is a module, else ``a``)."""
    mods: dict[str, Path] = {}
    for p in SRC.rglob("*.py"):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == "datapath" and (k := known(t)) and k != m:
                    graph[m].add(k)
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _may_import(package: str) -> set[str]:
    out, todo = set(BASE), list(BELOW[package])
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += BELOW[p]
    out.discard(package)
    return out


def test_every_package_has_a_place_in_the_layers() -> None:
    packages = {_package(m) for m in _module_graph()}
    assert packages <= set(BELOW), f"packages without a layer in BELOW: {sorted(packages - set(BELOW))}"


def test_no_package_imports_one_above_it() -> None:
    """Package to package, module-level and function-level imports: only arrows down the layers of BELOW."""
    bad = sorted(f"{m} -> {t}" for m, ts in _module_graph().items() for t in ts
                 if _package(t) != _package(m) and _package(t) not in _may_import(_package(m)))
    assert bad == [], "imports up a layer:\n" + "\n".join(bad)


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# The bar is at most one import circle.  This is the one left, owned by the work that removes it; it may shrink or
# split, never grow, and no new one may appear (offload's, unified_tensor's, loaders', nn's and graph's are gone).
KNOWN_CIRCLES: dict[str, tuple[str, ...]] = {  # module-name patterns (fnmatch)
    # ops: the plan, its tuner and the backends
    "ops: plan, tuner, backends": tuple(
        f"datapath.ops.{m}" for m in ("_cuda_backend", "_inputs", "_spmm", "_tune", "aggregate", "plan")),
}


def _known(circle: set[str]) -> bool:
    return any(all(any(fnmatch.fnmatchcase(m, pat) for pat in pats) for m in circle)
               for pats in KNOWN_CIRCLES.values())


def test_import_circles_are_known_and_do_not_grow() -> None:
    circles = _circles(_module_graph())
    unknown = [sorted(c) for c in circles if not _known(c)]
    assert unknown == [], "new import circles (break them; at most one may stay):\n" + "\n".join(map(str, unknown))
    print(f"{len(circles)} import circles left (bar: at most one):", *map(sorted, circles), sep="\n  ")


def test_offload_has_no_import_circle() -> None:
    """offload is a one-way flow (hooks -> policy -> transfers -> store; the cache only assembles the parts): no
    import circle among its modules, module-level, function-level and ``TYPE_CHECKING`` imports all counted."""
    inside = {m: {t for t in ts if t == "datapath.offload" or t.startswith("datapath.offload.")}
              for m, ts in _module_graph().items() if m == "datapath.offload" or m.startswith("datapath.offload.")}
    assert "datapath.offload.scopes" in inside["datapath.offload.hooks"]  # the graph holds offload's own arrows
    circles = _circles(inside)
    assert circles == [], "import circles inside datapath.offload:\n" + "\n".join(map(str, map(sorted, circles)))


def test_the_circle_finder_finds_a_circle_and_nothing_else() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _circles(g) == [{"a", "b", "c"}]
    assert _circles({"x": {"y"}, "y": set()}) == []


def test_the_graph_sees_function_level_imports(tmp_path: Path) -> None:
    graph = _module_graph()
    assert "datapath.memory.rows" in graph["datapath.unified_tensor.tensor"]  # imported inside a function
    assert not any(_package(t) == "unified_tensor" for t in graph["datapath.memory.placement"])


@pytest.mark.parametrize("module", ["_prefetch.py", "_exchange_stage.py", "_batch_steps.py"])
def test_the_prefetcher_knows_the_loader_only_through_its_batch_steps(module: str) -> None:
    """The prefetcher's modules (loaders/_prefetch.py, its exchange stage, the batch steps) read none of the
    loader's private methods or fields (issue 37 item 4)."""
    loader_src = ast.parse((SRC / "loaders" / "loader.py").read_text())
    private = {n.attr for n in ast.walk(loader_src) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and isinstance(n.value, ast.Name) and n.value.id == "self"}
    private |= {n.name for n in ast.walk(loader_src) if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
                and not n.name.startswith("__")}
    prefetch_src = ast.parse((SRC / "loaders" / module).read_text())
    own = {n.name for n in ast.walk(prefetch_src) if isinstance(n, ast.FunctionDef)}
    used = sorted({n.attr for n in ast.walk(prefetch_src) if isinstance(n, ast.Attribute)} & private - own)
    assert len(private) >= 8 and used == [], f"{module} reaches into the loader: {used}"
    assert not any(t.startswith("datapath.loaders.loader") for t in _imports(SRC / "loaders" / module))


def test_one_launch_path() -> None:
    """One stream reference, one argument packer (CuPy's CPointer), one kernel lookup: `datapath._runtime.launch`,
    used by memory and ops (issue 37 item 3)."""
    packers, stream_refs = [], []
    for p in _files("src"):
        tree = ast.parse(p.read_text())
        name = str(p.relative_to(SRC))
        packers += [name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "cupy.cuda.function"
                    and any(a.name == "CPointer" for a in n.names)]
        stream_refs += [f"{name}:{n.name}" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                        and any(isinstance(b, ast.Assign) and ast.unparse(b).replace("'", '"') == '__slots__ = ("ptr",)'
                                for b in n.body)]
    assert packers == ["_runtime/launch.py"], f"argument packers (CPointer): {packers}"
    assert stream_refs == ["_runtime/launch.py:StreamRef"], f"stream references: {stream_refs}"
    for package in ("memory", "ops"):
        users = [p for p in (SRC / package).rglob("*.py") if "datapath._runtime.launch" in _imports(p)
                 or any(m == "datapath._runtime" and "launch" in p.read_text() for m in _imports(p))]
        assert users, f"{package} does not launch through datapath._runtime.launch"


def test_no_source_file_is_oversized() -> None:
    big = {str(p.relative_to(ROOT)): n for p in _files("src", "benchmarks")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, f"files over {MAX_LINES} lines: {big}"


@pytest.mark.parametrize("package", ["memory", "unified_tensor", "graph", "sampling", "loaders", "features", "ops",
                                     "nn", "offload", "integrations", "analysis", "apps", "testing",
                                     "errors"])
def test_every_package_exports_what_it_lists(package: str) -> None:
    mod = importlib.import_module(f"datapath.{package}")
    names = getattr(mod, "__all__", None)
    assert names, f"datapath.{package} has no __all__"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"datapath.{package}.__all__ lists names it does not define: {missing}"
    assert mod.__doc__ and len(mod.__doc__.strip()) > 40, f"datapath.{package} needs a docstring saying what it is"
