"""Private per-process directories for offloaded activations.

Each process writes into ``<base>/datapath-offload-<host>-<pid>-<random>``,
created with mode 0700 (`tempfile.mkdtemp`), removed when the cache closes and
at interpreter exit.  A process killed before it could clean up leaves its
directory behind; the next `SpillDir` on the same base removes every such
directory whose process is gone (same host, same user, pid dead or reused).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import weakref
from pathlib import Path

import psutil

from datapath.offload.errors import OffloadConfigError

log = logging.getLogger("datapath.offload.spill_dir")

_PREFIX = "datapath-offload-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def _pid_is_alive_owner(pid: int, created_before: float) -> bool:
    """True when process ``pid`` exists and was started before ``created_before`` (so it made the directory)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= created_before + 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def clean_stale(base: Path) -> list[Path]:
    """Remove directories left in ``base`` by dead processes of this host and user; return what was removed."""
    removed: list[Path] = []
    pat = re.compile(re.escape(_PREFIX + _host()) + r"-(\d+)-")
    try:
        children = list(base.iterdir())
    except OSError:
        return removed
    for d in children:
        m = pat.match(d.name)
        if not m or not d.is_dir() or d.is_symlink():
            continue
        try:
            st = d.stat()
        except OSError:
            continue
        if st.st_uid != os.getuid():
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_is_alive_owner(pid, max(st.st_mtime, st.st_ctime)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            log.info("removed stale offload directory %s (process %d is gone)", d, pid)
    return removed


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SpillDir:
    """A private directory (mode 0700) under ``base`` that is removed by `remove` or at exit."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        base_path = Path(base).expanduser()
        try:
            base_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OffloadConfigError(
                f"cannot create the offload directory base {base_path}: {exc}. "
                f"Pass path= a writable directory on a local disk."
            ) from exc
        if not os.access(base_path, os.W_OK | os.X_OK):
            raise OffloadConfigError(f"offload path {base_path} is not writable; pass path= a writable directory")
        self.removed_stale = clean_stale(base_path)
        self.base = base_path
        self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{_host()}-{os.getpid()}-", dir=base_path))
        os.chmod(self.path, 0o700)
        self._finalizer = weakref.finalize(self, _remove, str(self.path))

    def file(self, name: str) -> str:
        """Path of file ``name`` inside the private directory."""
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive
