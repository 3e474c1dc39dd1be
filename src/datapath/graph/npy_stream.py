""".npy arrays read and written a block of rows at a time: tables larger than memory pass through in chunks.

`NpyWriter` writes a ``.npy`` file whose shape is known up front by appending rows (plain
file writes: nothing is memory-mapped, so the written pages never count towards the process's
resident memory).  `NpyReader` reads rows of a ``.npy`` file, or of an array inside an ``.npz``
archive (stored or deflated), in order, with the same guarantee; a (2, E) edge array stored
C-ordered is read as two streams (one per row).
"""
from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from datapath.graph.errors import DatasetError

#: Bytes a chunked read or write moves at once when the caller does not say.
DEFAULT_BLOCK_BYTES = 64 << 20


def read_npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the ``.npy`` header at ``f``'s position (format 1.0, 2.0 or 3.0), leaving
    ``f`` at the first data byte; ``ValueError`` when it is not one."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(f)
    elif version in ((2, 0), (3, 0)):  # 3.0 is 2.0 with a UTF-8 header: the same for numeric dtypes' ASCII
        shape, fortran, dtype = fmt.read_array_header_2_0(f)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    return tuple(int(s) for s in shape), bool(fortran), np.dtype(dtype)


class NpyWriter:
    """Write a ``.npy`` file of ``shape`` / ``dtype`` by `write` calls of whole rows, in order.

    ``close`` raises `DatasetError` (and removes the file) unless exactly ``shape[0]`` rows were
    written; used as a context manager, an exception inside removes the partial file.
    """

    def __init__(self, path: str | Path, shape: tuple[int, ...], dtype: Any) -> None:
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.rows = 0
        self._f: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        np.lib.format.write_array_header_1_0(self._f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                       "fortran_order": False, "shape": self.shape})

    def write(self, rows: np.ndarray) -> None:
        """Append ``rows`` (shape ``(k, *shape[1:])``, cast to ``dtype``)."""
        if self._f is None:
            raise DatasetError(f"{self.path}: write after close")
        a = np.ascontiguousarray(rows, dtype=self.dtype)
        if a.shape[1:] != self.shape[1:]:
            raise DatasetError(f"{self.path}: rows of shape {a.shape[1:]} written to an array of rows "
                               f"{self.shape[1:]}")
        if self.rows + a.shape[0] > self.shape[0]:
            raise DatasetError(f"{self.path}: more than the {self.shape[0]:,} rows declared")
        self._f.write(a.data if a.size else b"")
        self.rows += a.shape[0]

    def close(self) -> None:
        """Flush and close; `DatasetError` if fewer rows than declared were written."""
        if self._f is None:
            return
        f, self._f = self._f, None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        if self.rows != self.shape[0]:
            self.path.unlink(missing_ok=True)
            raise DatasetError(f"{self.path}: {self.rows:,} rows written, {self.shape[0]:,} declared")

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "NpyWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _read_into(f: BinaryIO, out: np.ndarray, where: str) -> None:
    """Fill ``out`` (C-contiguous) from ``f``; `DatasetError` if the file ends first."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise DatasetError(f"{where} ends early: the file is truncated ({got:,} of {view.nbytes:,} bytes read)")
        got += n


class NpyReader:
    """Read the rows of a ``.npy`` file, or of array ``member`` of an ``.npz`` archive, a block at a time.

    ``shape``, ``dtype`` and ``fortran_order`` come from the array's header; ``name`` says where
    it is (``"raw/data.npz:edge_index"``) for error messages.  Any problem reading it raises
    `DatasetError` naming it.
    """

    def __init__(self, path: str | Path, member: str | None = None) -> None:
        self.path = Path(path)
        self.member = member
        self.name = f"{self.path}:{member}" if member else str(self.path)
        with self._open() as f:
            self.shape, self.fortran_order, self.dtype = self._header(f)
            self.offset = f.tell()

    def _open(self) -> BinaryIO:
        try:
            if self.member is None:
                return open(self.path, "rb")  # noqa: SIM115 - the caller closes it
            z = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise DatasetError(f"{self.path} is missing") from None
        except (OSError, zipfile.BadZipFile) as exc:
            raise DatasetError(f"{self.path} cannot be read as an .npz archive ({exc})") from exc
        names = z.namelist()
        entry = f"{self.member}.npy"
        if entry not in names:
            keys = sorted(n[:-4] for n in names if n.endswith(".npy"))
            z.close()
            raise DatasetError(f"{self.path} has no array {self.member!r}; it holds {', '.join(keys) or 'none'}")
        info = z.getinfo(entry)
        if info.compress_type == zipfile.ZIP_STORED:  # np.savez: the bytes lie in the file as they are
            z.close()
            return _Slice(self.path, _data_offset(self.path, info), info.file_size)
        return _ZipMember(z, entry)

    def _header(self, f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
        try:
            shape, fortran, dtype = read_npy_header(f)
        except ValueError as exc:
            raise DatasetError(f"{self.name} is not a .npy array ({exc})") from exc
        if dtype.hasobject:
            raise DatasetError(f"{self.name} holds Python objects; only numeric arrays can be read")
        return shape, fortran, dtype

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    def rows(self, block_rows: int, start_byte: int = 0, count: int | None = None) -> Iterator[np.ndarray]:
        """Yield the rows (C order) in blocks of at most ``block_rows``.

        ``start_byte`` / ``count``: start that many bytes into the data and read ``count`` single
        values (a part of a larger array, e.g. one row of a C-ordered (2, E) array).
        """
        if self.fortran_order and len(self.shape) > 1:
            raise DatasetError(f"{self.name} is stored in Fortran order; save it C-ordered "
                               f"(np.ascontiguousarray) to read it a block of rows at a time")
        row_shape = self.row_shape if count is None else ()
        total = self.num_rows if count is None else count
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        block_rows = max(1, int(block_rows))
        with self._open() as f:
            f.seek(self.offset + start_byte)
            done = 0
            while done < total:
                k = min(block_rows, total - done)
                out = np.empty((k, *row_shape), self.dtype)
                _read_into(f, out, self.name)
                yield out
                done += k

    def read_all(self) -> np.ndarray:
        """The whole array (for small arrays: labels of a split, node counts)."""
        if self.fortran_order and len(self.shape) > 1:
            out = np.empty(self.shape[::-1], self.dtype)
            with self._open() as f:
                f.seek(self.offset)
                _read_into(f, out, self.name)
            return out.T
        parts = list(self.rows(max(1, self.num_rows)))
        return parts[0].reshape(self.shape) if parts else np.empty(self.shape, self.dtype)


class _ZipMember(io.RawIOBase):
    """A member of a zip file that closes the archive with itself and seeks (forward) in it."""

    def __init__(self, z: zipfile.ZipFile, name: str) -> None:
        super().__init__()
        self._z = z
        self._f = z.open(name)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readinto(self, b: Any) -> int:
        return self._f.readinto(b)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
            self._z.close()
        super().close()


def _data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where the data of a stored zip member starts: after its local header (30 bytes, name and extra field)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise DatasetError(f"{path}: a damaged zip entry {info.filename}")
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


class _Slice(io.RawIOBase):
    """``size`` bytes of a file from ``start``, read (and seeked) as a file of their own."""

    def __init__(self, path: Path, start: int, size: int) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._start, self._size = start, size
        self._f.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell() - self._start

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.tell(), 2: self._size}[whence]
        self._f.seek(self._start + min(max(base + pos, 0), self._size))
        return self.tell()

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        left = self._size - self.tell()
        return self._f.readinto(view[:max(0, min(len(view), left))]) if left > 0 else 0

    def read(self, n: int = -1) -> bytes:
        left = self._size - self.tell()
        return self._f.read(left if n < 0 else max(0, min(n, left)))

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()
