"""Remove files and folders when the process that made them dies, however it dies (SIGKILL included).

A `Reaper` starts a tiny watchdog process in its own session (so a Ctrl-C or a ``killpg`` of the
owner's group does not reach it) that holds the read end of a pipe whose write end only the owner
holds.  When the owner exits or is killed, the kernel closes that end; the watchdog reads end-of-file
and removes the paths matching its glob patterns.  Nothing is polled and nothing depends on a later
job to clean up.  The pipe is not inherited by processes the owner spawns (non-inheritable
descriptors), so children that outlive the owner do not keep the paths alive.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence

_WATCHDOG = r"""
import glob, os, shutil, sys
try:
    sys.stdin.buffer.read()  # returns at end-of-file: the owner exited or was killed
except BaseException:
    pass
for pattern in sys.argv[1:]:
    for path in glob.glob(pattern):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass
"""

_live: list["Reaper"] = []  # held for the life of the process: dropping one would fire it early
_lock = threading.Lock()


class Reaper:
    """Remove the paths matching ``patterns`` (glob) when this process ends, or at `fire`.

    Keep the paths that must outlive the process out of it; `cancel` forgets the patterns (the
    watchdog exits without removing anything).
    """

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = [str(p) for p in patterns]
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, *self.patterns], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        with _lock:
            _live.append(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fire(self, wait: bool = True) -> None:
        """Remove the paths now (the owner is done with them)."""
        self._close()
        if wait:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def cancel(self) -> None:
        """Stop watching: the watchdog exits and removes nothing."""
        self._proc.kill()
        self._proc.wait()
        self._close()

    def _close(self) -> None:
        with _lock:
            if self in _live:
                _live.remove(self)
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
