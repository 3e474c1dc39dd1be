"""Private per-process directories for offloaded activations, and their clean-up in every exit path.

Each process writes into ``<base>/datapath-offload-<host>-<pid>-<random>``, made
with mode 0700 (`tempfile.mkdtemp`).  The directory is removed

- when its store closes, and at interpreter exit (a `weakref.finalize`);
- on SIGTERM: a handler removes every live directory, then chains to the handler
  that was installed before it (or, if that was the default, re-raises the
  signal so the process still ends with SIGTERM's status);
- after a crash (SIGKILL, out of memory): every directory is recorded in a
  per-user registry (``<tmp>/datapath-offload-<uid>``); the next `SpillDir` of
  any process of this user on this host removes the directories of dead
  processes, whatever base path they were made under.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from datapath.offload.errors import OffloadConfigError

log = logging.getLogger("datapath.offload.spill_dir")

PREFIX = "datapath-offload-"

_live: dict[str, Path | None] = {}   # directory -> its registry record (None: not recorded)
_live_lock = threading.Lock()
_previous_handler: Any = None
_installed = False


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def registry_dir() -> Path:
    """Where this user's live offload directories are recorded (``<tmp>/datapath-offload-<uid>``)."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{os.getuid()}"


def _pid_is_alive_owner(pid: int, created_before: float) -> bool:
    """True when process ``pid`` exists and was started before ``created_before`` (so it made the directory)."""
    try:
        return psutil.Process(pid).create_time() <= created_before + 1.0
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def _stale(d: Path, pid: int) -> bool:
    """``d`` is a directory of this user whose process ``pid`` is gone."""
    if pid == os.getpid() or not d.is_dir() or d.is_symlink():
        return False
    try:
        st = d.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not _pid_is_alive_owner(pid, max(st.st_mtime, st.st_ctime))


def clean_stale(base: Path) -> list[Path]:
    """Remove directories left in ``base`` by dead processes of this host and user; return what was removed."""
    removed: list[Path] = []
    pat = re.compile(re.escape(PREFIX + _host()) + r"-(\d+)-")
    try:
        children = list(Path(base).iterdir())
    except OSError:
        return removed
    for d in children:
        m = pat.match(d.name)
        if m and _stale(d, int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
                log.info("removed stale offload directory %s (process %s is gone)", d, m.group(1))
    return removed


def reclaim_stale() -> list[Path]:
    """Remove the recorded directories of dead processes of this host and user, wherever they are."""
    reg = registry_dir()
    removed: list[Path] = []
    pat = re.compile(re.escape(_host()) + r"-(\d+)-.*\.path$")
    try:
        records = list(reg.iterdir())
    except OSError:
        return removed
    for rec in records:
        m = pat.match(rec.name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            d = Path(rec.read_text().strip())
            created = rec.stat().st_mtime
        except OSError:
            continue
        if pid == os.getpid() or _pid_is_alive_owner(pid, created):
            continue
        if d.name.startswith(f"{PREFIX}{_host()}-{pid}-") and d.is_dir() and not d.is_symlink() \
                and d.stat().st_uid == os.getuid():
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
                log.info("removed stale offload directory %s (process %d is gone)", d, pid)
        with contextlib.suppress(OSError):
            rec.unlink()
    return removed


def _record(path: Path) -> Path | None:
    reg = registry_dir()
    try:
        reg.mkdir(mode=0o700, exist_ok=True)
        if reg.stat().st_uid != os.getuid() or reg.is_symlink():
            return None
        rec = reg / f"{_host()}-{os.getpid()}-{path.name}.path"
        rec.write_text(str(path))
        return rec
    except OSError as exc:
        log.debug("offload directory registry not writable (%s); crash clean-up by base path only", exc)
        return None


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with _live_lock:
        rec = _live.pop(path, None)
    if rec is not None:
        with contextlib.suppress(OSError):
            rec.unlink()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    with _live_lock:
        paths = list(_live)
    for p in paths:
        _remove(p)
    prev = _previous_handler
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:  # the default action (or a handler not set from Python): end the process as SIGTERM would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_sigterm_handler() -> None:
    """Chain `_on_sigterm` in front of the current SIGTERM handler (main thread only; once)."""
    global _installed, _previous_handler
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        _previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True
    except (ValueError, OSError) as exc:  # not the main interpreter, or signals unavailable
        log.debug("no SIGTERM clean-up handler: %s", exc)


class SpillDir:
    """A private directory (mode 0700) under ``base``, removed by `remove`, at exit and on SIGTERM."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        base_path = Path(base).expanduser()
        try:
            base_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OffloadConfigError(
                f"path={str(base)!r}: cannot create the offload directory there ({exc}). "
                f"Pass path= a writable directory on a local disk."
            ) from exc
        if not base_path.is_dir():
            raise OffloadConfigError(f"path={str(base)!r} is not a directory; pass path= a writable directory")
        if not os.access(base_path, os.W_OK | os.X_OK):
            raise OffloadConfigError(f"path={str(base)!r} is not writable; pass path= a writable directory")
        self.removed_stale = reclaim_stale() + clean_stale(base_path)
        self.base = base_path
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=base_path))
        os.chmod(self.path, 0o700)
        rec = _record(self.path)
        with _live_lock:
            _live[str(self.path)] = rec
        _install_sigterm_handler()
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
