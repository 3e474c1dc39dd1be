"""Dataset and graph files: ``.npy`` reads that name the file on any error, and directories written all at once.

Directories are written into a temporary sibling, fsynced, then swapped into place.

A reader of the target sees either the old directory or the complete new one, never a
mix: the new one is built under ``.<name>.tmp-<pid>-<token>`` beside the target and
exchanged with it by ``renameat2(RENAME_EXCHANGE)`` (one atomic step on Linux), or, where
that call is missing, renamed in two steps (a crash between them leaves the target
missing and both copies beside it, which `load_dataset` reports by name).  A crash
before the swap leaves the old directory untouched; the temporary sibling is removed on
every way out of the writer (an exception, Ctrl-C, SIGTERM through the CLI), and otherwise
(SIGKILL, power loss) by the next write into the same target.

A full disk never crashes a writer: `check_free_space` compares the bytes a dataset needs with
what the filesystem has before anything is written, `reserve` allocates a memory-mapped file's
blocks before a store into the mapping could raise SIGBUS, and `disk_full` turns ENOSPC, EDQUOT
and EFBIG into one `DiskFullError` line naming the directory (or file), the bytes needed and free.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import io
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from datapath.graph.errors import DatasetError

log = logging.getLogger("datapath.graph.files")

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullError(DatasetError, OSError):
    """No room to write a dataset: the disk (or quota) is full, or a file would pass ``ulimit -f``."""


def npy_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """The exact size of the ``.npy`` file `np.save` writes for an array of ``shape`` and ``dtype``."""
    dt = np.dtype(dtype)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": tuple(shape)})
    return len(header.getvalue()) + int(np.prod(shape, dtype=np.int64)) * dt.itemsize


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_free_space(directory: Path, needed: int, what: str = "dataset") -> None:
    """Raise `DiskFullError` when the filesystem of ``directory`` has fewer than ``needed`` bytes free."""
    free = free_bytes(directory)
    if free < needed:
        raise DiskFullError(f"no room for the {what} in {directory}: it needs {needed:,} bytes and "
                            f"{free:,} are free; free space there or choose another directory")


@contextlib.contextmanager
def named(path: Path) -> Iterator[None]:
    """An `OSError` raised inside the block that names no file names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def reserve(path: Path, nbytes: int) -> None:
    """Allocate the first ``nbytes`` of ``path`` on disk now (``posix_fallocate``), so that stores into a
    memory mapping of it cannot hit a full disk (which raises SIGBUS, not an error)."""
    with named(path):
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)


def disk_full(exc: OSError, directory: Path, needed: int, what: str = "dataset") -> DiskFullError | None:
    """The one-line `DiskFullError` for ENOSPC / EDQUOT / EFBIG ``exc`` while writing into ``directory``
    (None for any other error)."""
    if exc.errno not in DISK_FULL_ERRNOS:
        return None
    if exc.errno == errno.EFBIG:
        name = exc.filename or directory
        return DiskFullError(f"cannot write {name}: the {what} needs {needed:,} bytes and the file would pass "
                             f"this process's file-size limit (ulimit -f); raise the limit or write elsewhere")
    try:
        free = free_bytes(directory if directory.exists() else directory.parent)
    except OSError:
        free = -1
    why = "the disk quota is exhausted" if exc.errno == errno.EDQUOT else "the disk is full"
    return DiskFullError(f"no room for the {what} in {directory} ({why}): it needs {needed:,} bytes and "
                         f"{max(free, 0):,} are free; free space there or choose another directory")

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_tree(d: Path) -> None:
    """fsync every file in ``d`` and ``d`` itself (the data and the names are on disk)."""
    for p in d.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(d)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux renameat2); False where the call is unavailable."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: the filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _stale_siblings(target: Path) -> list[Path]:
    prefix = f".{target.name}.tmp-"
    return [p for p in target.parent.glob(f"{prefix}*")
            if not _owner_alive(p.name[len(prefix):].split("-", 1)[0])]


def _owner_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_directory(target: Path, overwrite: bool, what: str = "directory") -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``target``; on success swap it into place (see module docstring).

    Raises ``FileExistsError`` if ``target`` exists, is not empty and ``overwrite`` is False, and
    ``NotADirectoryError`` if it is a file.  On an exception the temporary directory is removed and
    ``target`` is left as it was.
    """
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot write a {what} to {target}: it is a file, not a directory")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"cannot write a {what} to {target}: {parent} is a file, not a directory")
            break
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True (--overwrite) to replace "
                              f"the {what} in it")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_siblings(target):
        log.info("removing %s, left by an interrupted write", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if target.exists():
            if _exchange(tmp, target):
                fsync_dir(target.parent)
                shutil.rmtree(tmp)  # now the old directory
                return
            old = target.parent / f".{target.name}.tmp-{os.getpid()}-old-{secrets.token_hex(4)}"
            os.rename(target, old)
            os.rename(tmp, target)
            fsync_dir(target.parent)
            shutil.rmtree(old)
            return
        os.rename(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_npy(path: Path, mmap: bool = True) -> np.ndarray:
    """``np.load`` of ``path`` (memory-mapped copy-on-write by default); any failure is a `DatasetError` naming it."""
    try:
        return np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; the dataset is incomplete: re-create it with prepare-dataset") from None
    except (ValueError, OSError, EOFError) as exc:
        raise DatasetError(f"{path} cannot be read as a .npy array ({exc}); the file is truncated or corrupt: "
                           f"re-create the dataset with prepare-dataset") from exc


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[io.BufferedWriter]:
    """A binary file to write ``path`` through: a temporary sibling, fsynced and renamed into place on success,
    removed on any exception (a reader never sees a half-written file).  An `OSError` names ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with named(path), open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` through `atomic_file` (never a half-written file)."""
    with atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def save_json(path: Path, doc: Any) -> None:
    """Write ``doc`` as JSON to ``path`` through `atomic_file`."""
    with atomic_file(path) as f:
        f.write(json.dumps(doc).encode())


def manifest(d: Path, names: list[str]) -> dict[str, Any]:
    """``{name: {"bytes": size}}`` of the files ``names`` in ``d`` (what `check_manifest` verifies)."""
    return {n: {"bytes": (d / n).stat().st_size} for n in names if (d / n).is_file()}


def check_manifest(d: Path, files: dict[str, Any]) -> None:
    """Raise `DatasetError` naming the first file of ``files`` that is missing or of another size."""
    for name, info in sorted(files.items()):
        p = d / name
        if not p.is_file():
            raise DatasetError(f"{p} is missing (meta.json lists it); the dataset is incomplete: re-create it "
                               f"with prepare-dataset")
        size = p.stat().st_size
        if size != int(info["bytes"]):
            raise DatasetError(f"{p} has {size:,} bytes but meta.json recorded {int(info['bytes']):,}; the dataset "
                               f"is incomplete or was modified: re-create it with prepare-dataset")
