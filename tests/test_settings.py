"""Settings and sizes have one home each: a bad ``DATAPATH_*`` value never fails ``import datapath`` and is named
where it is used and by ``datapath info``; ``"0.8"``, ``0.8`` and ``"80%"`` mean the same share everywhere."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datapath.features import parse_budget
from datapath.memory import config_from_env
from datapath.offload import OffloadConfigError, offload, parse_memory_budget
from datapath.unified_tensor import share

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run(code: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC, **env})


@pytest.mark.slow
@pytest.mark.parametrize("name, value, accepted", [
    ("DATAPATH_GATHER_THREADS", "abc", "a multiple of 32 in [32, 1024]"),
    ("DATAPATH_GATHER_MODE", "bogus", "circular, shift_mask or unaligned"),
])
def test_a_bad_gather_variable_is_named_where_it_is_used_and_never_at_import(name: str, value: str,
                                                                              accepted: str) -> None:
    r = _run(["-c", "import datapath; print('imported', flush=True); datapath.memory.config_from_env()"],
             **{name: value})
    assert r.stdout == "imported\n", r.stderr
    assert "Traceback" in r.stderr and f"{name}={value!r}" in r.stderr and accepted in r.stderr, r.stderr
    with pytest.raises(ValueError, match=f"{name}={value!r}.*{accepted[:8]}"):
        config_from_env({name: value})
    info = _run(["-m", "datapath.cli", "info", "--no-measure"], **{name: value})
    assert info.returncode == 0, info.stderr
    assert f"bad setting: environment variable {name}={value!r}" in info.stdout and accepted in info.stdout


def test_info_names_an_unknown_variable() -> None:
    info = _run(["-m", "datapath.cli", "info", "--no-measure", "--json"], DATAPATH_GATHER_THREAD="64")
    assert info.returncode == 0 and "DATAPATH_GATHER_THREAD is not a datapath setting" in info.stdout


def test_shm_dir_pointing_at_a_file_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("DATAPATH_SHM_DIR", str(afile))
    with pytest.raises(ValueError, match="DATAPATH_SHM_DIR=.*a directory.*not a file"):
        share(torch.randn(4, 3), "h36-settings-test")


@pytest.mark.parametrize("value, share_of_1000", [(0.8, 800), ("0.8", 800), ("80%", 800), (0.25, 250),
                                                  ("1.0", 1000), ("512MiB", 512 << 20), ("10GB", 10**10),
                                                  (4096, 4096), ("4096", 4096)])
def test_one_size_parser_one_meaning(value: object, share_of_1000: int) -> None:
    assert parse_budget(value, 1000, "gpu_cache") == share_of_1000  # type: ignore[arg-type]
    assert parse_memory_budget(value, 1000) == share_of_1000  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1.5, "1.5", "ten", "150%", "1e999GB", True])
def test_unparsable_sizes_name_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="gpu_cache="):
        parse_budget(bad, 1000, "gpu_cache")  # type: ignore[arg-type]
    with pytest.raises(OffloadConfigError, match="memory_budget="):
        parse_memory_budget(bad, 1000)  # type: ignore[arg-type]


def test_offload_memory_budget_1_5_is_an_error_naming_it() -> None:
    model = torch.nn.Linear(8, 8)
    with pytest.raises(OffloadConfigError, match=r"memory_budget=1\.5 is neither a share in \[0, 1\] nor a whole"):
        with offload(model, memory_budget=1.5):
            pass


def test_datapath_variables_are_read_in_one_module() -> None:
    """Only ``_runtime/settings.py`` reads ``DATAPATH_*`` variables (the fuzz runner saves and restores one around
    a case: a write, not a setting it reads)."""
    import re  # noqa: PLC0415

    root = Path(SRC) / "datapath"
    reads = re.compile(r"(environ\.get|getenv)\(\s*[\"']DATAPATH_")
    bad = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
           if p.relative_to(root).as_posix() not in ("_runtime/settings.py", "testing/fuzz.py")
           for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert bad == [], bad
