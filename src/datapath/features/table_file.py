"""`TableFile`: a table of rows in a file on disk (a ``.npy`` file, or raw rows at an offset), checked on open.

``prepare-dataset``'s ``features.npy`` is one: the disk tier reads its rows at the
array's data offset (after the ``.npy`` header), O_DIRECT, a page at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from datapath.features.errors import FeatureStoreError
from datapath.graph.npy_stream import read_npy_header

_TORCH_DTYPES = {
    np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
    np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
}


def _numpy_dtype(dtype: torch.dtype | np.dtype | str) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        for np_dtype, t in _TORCH_DTYPES.items():
            if t == dtype:
                return np_dtype
        raise FeatureStoreError(f"dtype {dtype} cannot be stored in a table file; use a numpy-compatible dtype")
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise FeatureStoreError(f"dtype {dtype!r} is not a dtype ({exc})") from None


@dataclass(frozen=True)
class TableFile:
    """Rows of a table stored in ``path``: row ``i`` is ``row_bytes`` bytes at ``offset + i * row_bytes``.

    Make one with `TableFile.open`, which checks that the file exists and that its size
    matches the shape.
    """

    path: Path
    shape: tuple[int, ...]
    np_dtype: np.dtype
    offset: int

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.np_dtype]

    @property
    def num_rows(self) -> int:
        return int(self.shape[0])

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.np_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @classmethod
    def open(cls, path: str | os.PathLike, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | np.dtype | str | None = None, offset: int = 0) -> "TableFile":
        """Describe the table in ``path``: a ``.npy`` file (shape and dtype from its header, which
        ``shape``/``dtype`` must match if given), or raw rows at ``offset`` (``shape`` and ``dtype`` required).

        Raises:
            FeatureStoreError: the file does not exist, is not a C-ordered ``.npy``, or its size
                does not match the shape (naming the file).
        """
        p = Path(path)
        if not p.is_file():
            raise FeatureStoreError(f"the table file {p} does not exist (or is not a regular file)")
        size = p.stat().st_size
        if p.suffix == ".npy":
            file_shape, file_dtype, data_offset = _npy_header(p)
            if shape is not None and tuple(shape) != file_shape:
                raise FeatureStoreError(f"{p} holds an array of shape {file_shape}, not the shape {tuple(shape)} given")
            if dtype is not None and _numpy_dtype(dtype) != file_dtype:
                raise FeatureStoreError(f"{p} holds {file_dtype} values, not the dtype {dtype} given")
            shape, np_dtype, offset = file_shape, file_dtype, data_offset
        else:
            if shape is None or dtype is None:
                raise FeatureStoreError(f"{p} is not a .npy file: give its shape and dtype "
                                        f"(TableFile.open(path, shape=(N, F), dtype=torch.float32))")
            shape, np_dtype = tuple(int(s) for s in shape), _numpy_dtype(dtype)
        if len(shape) < 1 or any(s < 0 for s in shape):
            raise FeatureStoreError(f"the table in {p} must have a shape (N, ...) with sizes >= 0, got {shape}")
        if offset < 0:
            raise FeatureStoreError(f"offset must be >= 0, got {offset}")
        if np_dtype not in _TORCH_DTYPES:
            raise FeatureStoreError(f"{p} holds {np_dtype} values, which the feature store does not read")
        table = cls(p, tuple(shape), np_dtype, int(offset))
        expected = table.offset + table.nbytes
        if size != expected:
            raise FeatureStoreError(
                f"{p} has {size:,} bytes but a table of shape {table.shape} and dtype {np_dtype} at offset "
                f"{table.offset} needs {expected:,}; the file is truncated, or the shape or dtype is wrong")
        return table

    def memmap(self) -> np.ndarray:
        """The rows as a read-only ``np.memmap`` (buffered reads through the page cache)."""
        if self.num_rows == 0:
            return np.empty(self.shape, dtype=self.np_dtype)
        return np.memmap(self.path, dtype=self.np_dtype, mode="r", offset=self.offset, shape=self.shape)


def _npy_header(p: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of a ``.npy`` file, without reading its data."""
    try:
        with open(p, "rb") as f:
            shape, fortran, dtype = read_npy_header(f)
            offset = f.tell()
    except (ValueError, OSError, EOFError) as exc:
        raise FeatureStoreError(f"{p} cannot be read as a .npy file ({exc})") from None
    if fortran and len(shape) > 1:
        raise FeatureStoreError(f"{p} stores its array in Fortran order; rows must be contiguous (C order)")
    if dtype.hasobject:
        raise FeatureStoreError(f"{p} holds Python objects, not a numeric table")
    return shape, dtype, int(offset)


def write_table(path: str | os.PathLike, table: np.ndarray | torch.Tensor, align: int = 4096,
                chunk_bytes: int = 256 << 20, fsync: bool = True) -> TableFile:
    """Write ``table`` ((N, ...) C-contiguous, CPU) as a ``.npy`` file whose data starts at a multiple of ``align``
    bytes (the header padded with spaces; ``np.load`` reads it as usual).

    With the data page-aligned and rows of a size dividing 4 KiB, every row lies in one page, so
    the disk tier reads one page per row (after numpy's 64-byte-aligned header one row in eight
    straddles two pages: 12.5% more bytes for 512-byte rows).  Returns the `TableFile`.
    """
    arr = table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
    if not arr.flags.c_contiguous:
        raise FeatureStoreError("table must be C-contiguous (rows contiguous); pass np.ascontiguousarray(table)")
    if align < 64 or align > 8192 or align & (align - 1):  # numpy reads headers under 10,000 bytes
        raise FeatureStoreError(f"align must be a power of two in [64, 8192], got {align}")
    fmt = np.lib.format
    text = repr({"descr": fmt.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": tuple(arr.shape)})
    prefix = 10  # magic (6), version 1.0 (2), header length (2)
    total = -(-(prefix + len(text) + 1) // align) * align
    header = (text + " " * (total - prefix - len(text) - 1) + "\n").encode("latin1")
    if len(header) >= 10_000:
        raise FeatureStoreError(f"the .npy header of shape {arr.shape} padded to {align} bytes is too long for numpy")
    version, length = b"\x01\x00", len(header).to_bytes(2, "little")
    p = Path(path)
    flat = arr.reshape(-1).view(np.uint8)
    with open(p, "wb") as f:
        f.write(b"\x93NUMPY" + version + length + header)
        for lo in range(0, flat.size, chunk_bytes):
            f.write(memoryview(flat[lo:lo + chunk_bytes]))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return TableFile.open(p)
