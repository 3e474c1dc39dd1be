"""Issue 36 item 4: no way out of a read-only unified tensor hands out writable memory over the read-only mapping.

Writing through ``as_unified(np.load(f, mmap_mode="r")).numpy()`` used to crash the process (SIGSEGV, exit 139):
each case runs in a child process, so a crash is a failed test here, not a dead test run.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import datapath  # noqa: F401 - installs t.to("unified")
from datapath.memory import HostRecord, ReadOnlyTableError, is_unified
from datapath.unified_tensor import UnifiedTensor, as_unified, host_tensor

SRC = Path(__file__).resolve().parents[2] / "src"

_CHILD = """
import sys
import numpy as np
import datapath
from datapath.unified_tensor import as_unified
u = as_unified(np.load(sys.argv[1], mmap_mode="r"))
a = {way}
assert not a.flags.writeable, "a writeable array over a read-only mapping"
try:
    a[1, 2] = 7.0
except ValueError as e:
    print("refused:", e)
    sys.exit(0)
sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("way", ["u.numpy()", "np.asarray(u)", "u[1:3].numpy()", "u.t().numpy()"])
def test_writing_a_read_only_tables_array_raises_and_does_not_crash(tmp_path: Path, way: str) -> None:
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "child.py").write_text(textwrap.dedent(_CHILD.format(way=way)))
    r = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "x.npy")], capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, f"exit {r.returncode} (139/-11: the write crashed)\n{r.stdout}\n{r.stderr}"
    assert "refused: assignment destination is read-only" in r.stdout
    assert np.array_equal(np.load(tmp_path / "x.npy"), x)  # the file is untouched


def test_a_read_only_table_gives_no_writable_host_tensor(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    u = as_unified(np.load(tmp_path / "x.npy", mmap_mode="r"))
    with pytest.raises(ReadOnlyTableError, match=r"u\.numpy\(\)"):
        host_tensor(u)
    assert np.array_equal(u.numpy(), x) and np.array_equal(u.cpu().numpy(), x)
    c = u.cpu()  # a copy may be written
    c[0, 0] = 5.0
    assert c[0, 0] == 5.0 and u.numpy()[0, 0] == x[0, 0]


def test_a_writable_table_keeps_a_writable_array() -> None:
    t = torch.randn(5, 4, dtype=torch.float64)
    u = t.to("unified")
    a = u.numpy()
    assert a.flags.writeable
    a[2, 1] = 3.5
    assert u[2, 1].item() == 3.5 and host_tensor(u)[2, 1].item() == 3.5


def test_the_unified_type_is_built_on_the_memory_record() -> None:
    u = torch.randn(3, 2).to("unified")
    assert isinstance(u, HostRecord) and issubclass(UnifiedTensor, HostRecord)
    assert u.is_unified and is_unified(u) and not torch.randn(2).is_unified and not is_unified(torch.randn(2))
    assert u.host.data_ptr() == host_tensor(u).data_ptr() and not u.read_only
