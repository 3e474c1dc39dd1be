"""Tables in files (CSV, gzip CSV, ``.npy``, an ``.npz`` member, Parquet) read a block of rows at a time.

Every table yields ``(first_row, rows)`` blocks of a 2-D array within a byte budget and says
where a row is (``"line 12"`` of a CSV, ``"row 12"`` of an array) so that a bad value is
reported by file, line and column.  Edge lists are tables of two columns (source, destination);
`edge_chunks` checks their ids and turns them into the ``(src, dst)`` chunks
`datapath.graph.external_sort.edges_to_csr` reads.
"""
from __future__ import annotations

import gzip
import io
import itertools
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from datapath._runtime.optional import require
from datapath.graph.errors import DatasetError
from datapath.graph.npy_stream import NpyReader

Block = tuple[int, np.ndarray]


class Table:
    """A table of ``num_cols`` columns in a file; ``num_rows`` is None until read where the format does not say."""

    name: str
    num_cols: int
    num_rows: int | None

    def blocks(self, budget: int) -> Iterator[Block]:
        raise NotImplementedError

    def where(self, row: int) -> str:
        """Where row ``row`` (0-based, data rows) is, for messages: ``"line 13"``, ``"row 12"``."""
        return f"row {row}"

    def error(self, row: int, col: int | None, what: str) -> DatasetError:
        at = self.where(row) + ("" if col is None else f", column {col + 1}")
        return DatasetError(f"{self.name}, {at}: {what}")


class ArrayTable(Table):
    """A ``.npy`` file, or array ``member`` of an ``.npz`` archive: (N,) is read as (N, 1)."""

    def __init__(self, path: str | Path, member: str | None = None) -> None:
        self.reader = NpyReader(path, member)
        self.name = self.reader.name
        shape = self.reader.shape
        if len(shape) not in (1, 2):
            raise DatasetError(f"{self.name} has shape {shape}; expected a table (N, F) or a column (N,)")
        self.num_rows = shape[0]
        self.num_cols = shape[1] if len(shape) == 2 else 1
        self.dtype = self.reader.dtype

    def blocks(self, budget: int) -> Iterator[Block]:
        rows = max(1, budget // max(1, 2 * self.num_cols * self.dtype.itemsize))
        first = 0
        for a in self.reader.rows(rows):
            yield first, a.reshape(len(a), self.num_cols)
            first += len(a)


class EdgeIndexTable(Table):
    """A (2, E) edge array (PyG / OGB ``edge_index``: row 0 sources, row 1 destinations) read as an (E, 2) table."""

    def __init__(self, path: str | Path, member: str | None = None) -> None:
        self.reader = NpyReader(path, member)
        self.name = self.reader.name
        if len(self.reader.shape) != 2 or self.reader.shape[0] != 2:
            raise DatasetError(f"{self.name} has shape {self.reader.shape}; an edge_index has shape (2, E)")
        self.num_rows = self.reader.shape[1]
        self.num_cols = 2
        self.dtype = self.reader.dtype

    def where(self, row: int) -> str:
        return f"edge {row} (edge_index[:, {row}])"

    def blocks(self, budget: int) -> Iterator[Block]:
        rows = max(1, budget // (4 * self.dtype.itemsize))
        if self.reader.fortran_order:  # the bytes are (E, 2) C order: src, dst pairs
            flat = NpyReader(self.reader.path, self.reader.member)
            first = 0
            for a in flat.rows(2 * rows, 0, 2 * self.num_rows):
                yield first, a.reshape(-1, 2)
                first += len(a) // 2
            return
        e, item = self.num_rows, self.dtype.itemsize
        srcs = self.reader.rows(rows, 0, e)
        dsts = self.reader.rows(rows, e * item, e)
        first = 0
        for s, d in zip(srcs, dsts):
            yield first, np.stack([s, d], axis=1)
            first += len(s)


class CsvTable(Table):
    """A delimited text file (``.gz``: gzip), one row a line; ``#`` comment lines and blank lines skipped.

    ``delimiter``: None picks ``,`` or tab from the first data line, else any whitespace.
    ``header``: skip the first line.  ``integer``: values parse as int64 (node ids), else float64.
    """

    def __init__(self, path: str | Path, *, integer: bool, header: bool = False,
                 delimiter: str | None = None, num_cols: int | None = None) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.integer = integer
        self.header = header
        self.num_rows = None
        first = self._first_data_line()
        self._lines: list[int] = []  # line numbers of the rows of the block being read
        self._block_first = 0
        if first is None:
            self.delimiter, self.num_cols = delimiter or ",", num_cols or 0
            return
        line_no, text = first
        self.delimiter = delimiter if delimiter is not None else "," if "," in text else "\t" if "\t" in text \
            else None
        self.num_cols = len(self._fields(text))
        if num_cols is not None and self.num_cols != num_cols:
            raise DatasetError(f"{self.name}, line {line_no}: {self.num_cols} columns; expected {num_cols}")

    def _open(self) -> io.TextIOBase:
        try:
            if self.path.suffix == ".gz":
                return gzip.open(self.path, "rt", newline="")
            return open(self.path, newline="")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            raise DatasetError(f"{self.path} is missing") from None

    def _first_data_line(self) -> tuple[int, str] | None:
        with self._open() as f:
            try:
                for no, line in enumerate(f, 1):
                    if no == 1 and self.header:
                        continue
                    if line.strip() and not line.lstrip().startswith("#"):
                        return no, line
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise DatasetError(f"{self.name} cannot be read as text ({exc})") from exc
        return None

    def _fields(self, line: str) -> list[str]:
        text = line.strip()
        return text.split(self.delimiter) if self.delimiter is not None else text.split()

    def where(self, row: int) -> str:
        i = row - self._block_first
        return f"line {self._lines[i]}" if 0 <= i < len(self._lines) else f"data row {row + 1}"

    def blocks(self, budget: int) -> Iterator[Block]:
        dtype = np.int64 if self.integer else np.float64
        with self._open() as f:
            line_no = 0
            if self.header:
                f.readline()
                line_no = 1
            first_row = 0
            per_line = 200 + 24 * self.num_cols  # the str, list slot and parsed values of one line
            while True:
                try:
                    lines = list(itertools.islice(f, max(64, budget // per_line)))
                except (OSError, EOFError, UnicodeDecodeError) as exc:
                    raise DatasetError(f"{self.name} after line {line_no}: cannot be read ({exc})") from exc
                if not lines:
                    return
                if self.num_cols == 0:
                    raise DatasetError(f"{self.name}: no data lines")
                a = self._parse(lines, line_no, dtype)
                per_line = max(per_line, 2 * (64 + sum(map(len, lines[:256])) // min(len(lines), 256))
                               + 24 * self.num_cols)
                line_no += len(lines)
                self._block_first = first_row
                yield first_row, a
                first_row += len(a)

    def _parse(self, lines: list[str], before: int, dtype: Any) -> np.ndarray:
        """Parse one block; ``self._lines`` maps its rows to line numbers (for `where`)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy warns about blank lines
                a = np.loadtxt(lines, delimiter=self.delimiter, dtype=dtype, ndmin=2, comments="#")
        except ValueError as exc:
            raise self._locate(lines, before) or DatasetError(f"{self.name} after line {before}: {exc}") from None
        if a.shape[0] != len(lines):  # blank or comment lines: map rows to lines
            self._lines = [before + i + 1 for i, t in enumerate(lines)
                           if t.strip() and not t.lstrip().startswith("#")]
        else:
            self._lines = list(range(before + 1, before + 1 + len(lines)))
        if a.shape[0] and a.shape[1] != self.num_cols:
            raise DatasetError(f"{self.name}, line {self._lines[0]}: {a.shape[1]} columns; expected "
                               f"{self.num_cols}")
        return a

    def _locate(self, lines: list[str], before: int) -> DatasetError | None:
        """The first line of ``lines`` that does not parse, as an error naming line and column."""
        parse: Callable[[str], Any] = int if self.integer else float
        kind = "an integer" if self.integer else "a number"
        for i, line in enumerate(lines):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = self._fields(line)
            if len(fields) != self.num_cols:
                return DatasetError(f"{self.name}, line {before + i + 1}: {len(fields)} columns; expected "
                                    f"{self.num_cols}")
            for c, v in enumerate(fields):
                try:
                    parse(v)
                except ValueError:
                    return DatasetError(f"{self.name}, line {before + i + 1}, column {c + 1}: {v.strip()!r} is "
                                        f"not {kind}")
        return None


class ParquetTable(Table):
    """Columns ``columns`` (default: all) of a Parquet file (pyarrow), as one numeric table."""

    def __init__(self, path: str | Path, columns: list[str] | None = None) -> None:
        pq = require("pyarrow.parquet", extra="io", purpose=f"reading the Parquet file {path}")
        self.path = Path(path)
        self.name = str(self.path)
        if not self.path.exists():
            raise DatasetError(f"{self.path} is missing")
        try:
            self.file = pq.ParquetFile(self.path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types
            raise DatasetError(f"{self.path} cannot be read as Parquet ({exc})") from exc
        names = self.file.schema_arrow.names
        missing = [c for c in columns or [] if c not in names]
        if missing:
            raise DatasetError(f"{self.path} has no column {', '.join(map(repr, missing))}; its columns are "
                               f"{', '.join(names)}")
        self.columns = list(columns) if columns else names
        self.num_cols = len(self.columns)
        self.num_rows = self.file.metadata.num_rows
        for c in self.columns:
            t = self.file.schema_arrow.field(c).type
            if not (str(t).startswith(("int", "uint", "float", "double", "halffloat"))):
                raise DatasetError(f"{self.path}, column {c!r}: type {t}; expected numbers")

    def blocks(self, budget: int) -> Iterator[Block]:
        rows = max(1, budget // (32 * self.num_cols))
        first = 0
        for batch in self.file.iter_batches(batch_size=rows, columns=self.columns):
            cols = []
            for i, c in enumerate(batch.columns):
                if c.null_count:
                    row = first + int(np.flatnonzero(c.is_null().to_numpy(zero_copy_only=False))[0])
                    raise self.error(row, i, f"a missing value (null) in column {self.columns[i]!r}")
                cols.append(c.to_numpy(zero_copy_only=False))
            yield first, np.stack(cols, axis=1) if cols else np.empty((batch.num_rows, 0))
            first += batch.num_rows


def edge_chunks(table: Table, num_nodes: int | None = None,
                reverse: bool = False) -> Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]:
    """``(src, dst)`` chunks of an edge table (column 0 sources, column 1 destinations), ids checked.

    A float, negative or too-large id raises `DatasetError` naming the table, row and column.
    ``reverse``: each edge ``u -> v`` followed by ``v -> u`` (OGB's ``add_inverse_edge``).
    Returns a function of a byte budget, as `edges_to_csr` takes it.
    """
    if table.num_cols != 2:
        raise DatasetError(f"{table.name} has {table.num_cols} columns; an edge list has 2 (source, destination)")

    def chunks(budget: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for first, a in table.blocks(budget // (2 if reverse else 1)):
            a = check_ids(table, first, a, num_nodes, "node id")
            if reverse:
                yield a.ravel(), a[:, ::-1].ravel()
            else:
                yield a[:, 0], a[:, 1]
    return chunks


def check_ids(table: Table, first: int, a: np.ndarray, bound: int | None, what: str) -> np.ndarray:
    """``a`` as int64 ids in ``[0, bound)``; else `DatasetError` at the first bad value's row and column."""
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise table.error(first + int(r), int(c), f"{a[r, c].item()!r} is not an integer {what}")
        a = a.astype(np.int64)
    elif a.dtype.kind not in "iu":
        raise DatasetError(f"{table.name} holds {a.dtype} values; {what}s must be integers")
    if a.size:
        neg = a < 0
        if neg.any():
            r, c = np.argwhere(neg)[0]
            raise table.error(first + int(r), int(c), f"{int(a[r, c])} is a negative {what}")
        if bound is not None:
            big = a >= bound
            if big.any():
                r, c = np.argwhere(big)[0]
                raise table.error(first + int(r), int(c), f"{what} {int(a[r, c])} is out of range: there are "
                                  f"{bound:,} nodes (ids 0..{bound - 1})")
    return a.astype(np.int64, copy=False)
