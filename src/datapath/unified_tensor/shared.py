"""One copy of a table in shared host memory, mapped by every process on the machine.

Data-parallel training runs one process per GPU; each would otherwise hold its own
copy of the node features.  `share` writes a tensor once into a file in
``/dev/shm`` (RAM-backed) and returns a unified tensor over it; `attach`, in any
other process, maps the same pages and pins them for *its* GPU (``cudaHostRegister``
of its own mapping) — no process copies the table.

    # rank 0                                     # every rank, after a barrier
    feats = share(feats, "products-x")           feats = attach("products-x")
                                                 rows = feats[cuda_idx]   # zero copy

Lifetime: the process that shared a table removes its files when it exits (or on
`unlink`); a table left behind by a process that died is removed by the next
`share` or by `cleanup_stale`.  Set ``DATAPATH_SHM_DIR`` to use another directory
(a ``.npy`` directory on disk works the same way through the page cache).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import torch

from datapath._runtime import settings
from datapath._runtime.errors import DatapathError
from datapath.unified_tensor.memory import as_unified
from datapath.unified_tensor.tensor import Affinity, UnifiedTensor

log = logging.getLogger("datapath.unified_tensor.shared")

_PREFIX = "datapath-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_owned: set[str] = set()
_lock = threading.Lock()


class SharedTableError(DatapathError):
    """A shared table could not be created, found or attached."""


def shm_dir() -> Path:
    """The directory holding shared tables (``$DATAPATH_SHM_DIR`` or ``/dev/shm``).

    Raises:
        SettingError: ``DATAPATH_SHM_DIR`` names a file (or is empty).
    """
    return settings.get("DATAPATH_SHM_DIR")


def _paths(name: str) -> tuple[Path, Path]:
    if not _NAME_RE.match(name):
        raise ValueError(f"shared table names use letters, digits, '_', '-', '.' (1-128 chars); got {name!r}")
    d = shm_dir()
    return d / f"{_PREFIX}{name}.bin", d / f"{_PREFIX}{name}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a torch dtype is stored as (bfloat16 travels as uint16)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _map(path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over the file's pages (MAP_SHARED: writes are seen by every process)."""
    np_dtype = _storage_dtype(dtype)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return torch.empty(shape, dtype=dtype)
    arr = np.memmap(path, dtype=np_dtype, mode="r+", shape=shape)
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def cleanup_stale() -> list[str]:
    """Remove shared tables whose owning process is dead; returns their names."""
    removed = []
    d = shm_dir()
    if not d.is_dir():
        return removed
    for meta in d.glob(f"{_PREFIX}*.json"):
        try:
            owner = int(json.loads(meta.read_text())["owner_pid"])
        except (OSError, ValueError, KeyError):
            continue
        if not _alive(owner):
            name = meta.name[len(_PREFIX):-len(".json")]
            data = meta.with_suffix(".bin")
            for p in (data, meta):
                p.unlink(missing_ok=True)
            removed.append(name)
            log.info("removed shared table %r left behind by dead process %d", name, owner)
    return removed


def share(t: torch.Tensor, name: str, affinity: Affinity = "host", overwrite: bool = False) -> UnifiedTensor:
    """Copy ``t`` once into shared memory under ``name``; return a unified tensor over it.

    Args:
        t: (N, ...) tensor on any device, any dtype.
        name: identifier other processes pass to `attach`.
        affinity: affinity of the returned unified tensor.
        overwrite: replace an existing table of that name owned by a live process.

    Raises:
        SharedTableError: the name is taken, or the directory has no room (the
            partial file is removed).
    """
    cleanup_stale()
    data, meta = _paths(name)
    if meta.exists() and not overwrite:
        raise SharedTableError(f"a shared table named {name!r} exists ({meta}); pick another name or overwrite=True")
    src = t.detach()
    if isinstance(src, UnifiedTensor):
        src = src._host
    src = src.to("cpu").contiguous()
    nbytes = src.numel() * src.element_size()
    shm_dir().mkdir(parents=True, exist_ok=True)
    tmp = data.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))  # fail now, not with SIGBUS later
        dst = _map(tmp, src.dtype, tuple(src.shape))
        if src.numel():
            dst.copy_(src)
        os.replace(tmp, data)
        info = {"shape": list(src.shape), "dtype": str(src.dtype).removeprefix("torch."),
                "owner_pid": os.getpid(), "created": time.time(), "nbytes": nbytes}
        tmp_meta = meta.with_suffix(f".json.tmp{os.getpid()}")
        tmp_meta.write_text(json.dumps(info))
        os.replace(tmp_meta, meta)  # attachers wait for this file: it appears complete
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SharedTableError(
            f"cannot place {nbytes / 2**30:.2f} GiB in {shm_dir()} ({exc}); free space there or set DATAPATH_SHM_DIR"
        ) from exc
    with _lock:
        _owned.add(name)
    return attach(name, affinity=affinity)


def attach(name: str, affinity: Affinity = "host", timeout: float = 60.0) -> UnifiedTensor:
    """Map the shared table ``name`` (waiting up to ``timeout`` s for it) and pin it for this process's GPU.

    The mapping is shared: a write through any process's tensor is seen by all.
    """
    data, meta = _paths(name)
    deadline = time.monotonic() + timeout
    while not meta.exists():
        if time.monotonic() > deadline:
            raise SharedTableError(f"no shared table {name!r} in {shm_dir()} after {timeout:.0f} s; "
                                   f"did the owner call share(..., {name!r})?")
        time.sleep(0.05)
    try:
        info = json.loads(meta.read_text())
        dtype = getattr(torch, info["dtype"])
        shape = tuple(int(s) for s in info["shape"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SharedTableError(f"{meta} (the description of shared table {name!r}) is corrupt ({type(exc).__name__}: "
                               f"{exc}); its owner should share the table again (or remove {meta} and {data})") from None
    host = _map(data, dtype, shape)
    return as_unified(host, affinity=affinity)


def unlink(name: str) -> None:
    """Remove the shared table ``name`` (mappings that exist stay valid until they are freed)."""
    data, meta = _paths(name)
    meta.unlink(missing_ok=True)
    data.unlink(missing_ok=True)
    with _lock:
        _owned.discard(name)


def shared_tables() -> dict[str, dict]:
    """The shared tables in `shm_dir` and their metadata."""
    out = {}
    for meta in sorted(shm_dir().glob(f"{_PREFIX}*.json")):
        try:
            out[meta.name[len(_PREFIX):-len(".json")]] = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
    return out


@atexit.register
def _remove_owned() -> None:
    for name in list(_owned):
        try:
            unlink(name)
        except OSError:
            pass
