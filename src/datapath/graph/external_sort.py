"""Edge lists larger than memory turned into the project's CSR by an external sort under a memory budget.

The CSR is `datapath.graph.Graph`'s: row ``v`` lists the sources of the edges ``u -> v`` in
the order they appear in the edge list (a stable sort by destination: the same arrays as
``Graph.from_edge_index``).  Two passes:

1. runs: the edges are read a chunk at a time into a buffer that fits the budget; each full
   buffer is sorted by (destination, position) with numpy and written to disk as a run;
2. merge: the runs are read back a block at a time and merged (k-way, blockwise: every edge
   below the smallest last destination any run's block holds is final), and the merged edges
   are written straight into ``indptr.npy`` / ``indices.npy``.

Nothing is memory-mapped: runs and outputs are written and read with plain file I/O, so the
process's resident memory stays within the buffers (plus the interpreter).  An edge list that
fits one buffer is sorted in memory and written without runs.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datapath.graph.errors import InvalidGraphError
from datapath.graph.npy_stream import NpyWriter

log = logging.getLogger("datapath.graph.external_sort")

#: The smallest budget accepted (a few thousand edges per buffer).
MIN_MEMORY = 1 << 16
#: Bytes per buffered edge in the runs pass: src + dst (16), the sort key (8), gathered column (8).
RUN_BYTES_PER_EDGE = 32
#: Bytes per buffered edge in the merge: buffers, their concatenation, keys, the sort's work space, output.
MERGE_BYTES_PER_EDGE = 96
#: Share of the budget a reader's chunk may hold beside the run buffer.
READ_SHARE = 0.2
_ROWS_PER_WRITE = 1 << 20
_KEY_BITS = 32

EdgeChunks = Iterable[tuple[np.ndarray, np.ndarray]]


@dataclass
class CSRFiles:
    """What `edges_to_csr` wrote: ``indptr.npy`` (N+1,) int64 and ``indices.npy`` (E,) int32/int64 in ``directory``."""

    directory: Path
    num_nodes: int
    num_edges: int
    runs: int
    run_s: float
    merge_s: float


def read_budget(memory: int) -> int:
    """Bytes a reader's chunk may take (its parsing included) beside the sort's buffers, for ``memory``."""
    return max(1 << 14, int(memory * READ_SHARE))


def edges_to_csr(edges: EdgeChunks | Callable[[int], EdgeChunks], directory: str | Path, *, memory: int,
                 num_nodes: int | None = None, tmp_dir: str | Path | None = None,
                 total_edges: int | None = None, progress: bool = False) -> CSRFiles:
    """Write the CSR (by destination) of the edges ``src -> dst`` to ``directory``/``indptr.npy``, ``indices.npy``.

    ``edges``: an iterable of ``(src, dst)`` pairs of 1-D integer arrays (any lengths), or a
    function taking a byte budget (`read_budget`) and returning one.  ``memory``: bytes the
    sort's buffers may hold (>= `MIN_MEMORY`).  ``num_nodes``: default ``max id + 1``; ids
    must lie in ``[0, num_nodes)``.  ``tmp_dir``: where the runs go (default: a temporary
    directory inside ``directory``; the disk needs room for the edges once more).
    ``indices`` is int32 below 2**31 nodes, int64 otherwise.  Raises `InvalidGraphError` for
    bad ids.  ``progress``: tqdm bars over the edges of each pass.
    """
    if memory < MIN_MEMORY:
        raise ValueError(f"memory={memory:,} bytes is too small for the sort's buffers; give at least "
                         f"{MIN_MEMORY:,} bytes")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    chunks = edges(read_budget(memory)) if callable(edges) else edges
    run_edges = max(1024, int(memory * (1 - READ_SHARE)) // RUN_BYTES_PER_EDGE)
    work = Path(tempfile.mkdtemp(prefix=".edge-runs-", dir=tmp_dir if tmp_dir is not None else out))
    try:
        t0 = time.perf_counter()
        runs = _Runs(work, run_edges)
        with _bar(progress, total_edges, "sorting runs") as bar:
            for src, dst in chunks:
                runs.add(*_check_chunk(src, dst, num_nodes))
                bar.update(len(src))
        last = runs.finish()
        n = runs.max_id + 1 if num_nodes is None else int(num_nodes)
        e = runs.num_edges
        idx_dtype = np.int32 if n < 2**31 else np.int64
        t1 = time.perf_counter()
        writer = _CSRWriter(out, n, e, idx_dtype)
        try:
            with _bar(progress, e, "merging") as bar:
                if last is not None:  # one buffer held every edge: sorted in memory, no runs on disk
                    writer.emit(last[0], last[1], n)
                    bar.update(e)
                else:
                    blocks = max(1024, memory // (MERGE_BYTES_PER_EDGE * max(len(runs.files), 1)))
                    for d, s in _merge(runs.files, blocks):
                        writer.emit(d, s, None)
                        bar.update(len(d))
                    writer.emit(np.empty(0, np.int64), np.empty(0, np.int64), n)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return CSRFiles(out, n, e, len(runs.files), t1 - t0, time.perf_counter() - t1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bar(progress: bool, total: int | None, desc: str) -> Any:
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, unit="edge", unit_scale=True, disable=not progress, leave=False)


def _check_chunk(src: Any, dst: Any, num_nodes: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(src, dst, largest id)`` (-1 for no edges) of one chunk, after checking its shapes, dtypes and ids."""
    src, dst = np.asarray(src), np.asarray(dst)
    if src.ndim != 1 or src.shape != dst.shape:
        raise InvalidGraphError(f"an edge chunk must be two 1-D arrays of one length, got shapes {src.shape} "
                                f"and {dst.shape}")
    for a in (src, dst):
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise InvalidGraphError(f"node ids must be integers, got {a.dtype}")
    hi = -1
    if src.size:
        lo = min(int(src.min()), int(dst.min()))
        hi = max(int(src.max()), int(dst.max()))
        if lo < 0 or (num_nodes is not None and hi >= num_nodes):
            raise InvalidGraphError(f"node ids range over [{lo}, {hi}] but must lie in [0, "
                                    f"{num_nodes if num_nodes is not None else 'inf'})")
    return src, dst, hi


def _sort_by_dst(src: np.ndarray, dst: np.ndarray, stable_hint: bool = False,
                 reuse_dst: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(dst, src)`` ordered by (dst, position): a stable sort by destination.

    One int64 key per edge, ``dst << 32 | position`` (unique, so any sort is stable; timsort,
    ``stable_hint``, is fastest on concatenated sorted runs).  ``reuse_dst``: ``dst`` (int64) may
    be overwritten (it holds the positions afterwards), saving one array.
    """
    n = len(dst)
    if n and int(dst.max()) < 2**(63 - _KEY_BITS) and n < 2**_KEY_BITS:
        key = np.left_shift(dst, _KEY_BITS, dtype=np.int64)
        key |= np.arange(n, dtype=np.int64)
        key.sort(kind="stable" if stable_hint else None)
        out = dst if reuse_dst and dst.dtype == np.int64 else None
        pos = np.bitwise_and(key, (1 << _KEY_BITS) - 1, out=out)
        key >>= _KEY_BITS
        return key, src[pos]
    perm = np.argsort(dst, kind="stable")
    return dst[perm], src[perm]


def _narrow(a: np.ndarray, hi: int) -> np.ndarray:
    return a.astype(np.int32) if hi < 2**31 else a.astype(np.int64, copy=False)


class _Runs:
    """Pass 1: edges gathered into a buffer of ``run_edges``; each full buffer sorted and written as a run."""

    def __init__(self, work: Path, run_edges: int) -> None:
        self.work = work
        self.src = np.empty(run_edges, np.int64)
        self.dst = np.empty(run_edges, np.int64)
        self.fill = 0
        self.files: list[tuple[Path, Path, int, np.dtype]] = []
        self.num_edges = 0
        self.max_id = -1

    def add(self, src: np.ndarray, dst: np.ndarray, hi: int) -> None:
        """Buffer the edges ``src -> dst`` whose largest id is ``hi`` (from `_check_chunk`)."""
        self.max_id = max(self.max_id, hi)
        self.num_edges += src.size
        i = 0
        while i < src.size:
            k = min(src.size - i, self.src.size - self.fill)
            self.src[self.fill:self.fill + k] = src[i:i + k]
            self.dst[self.fill:self.fill + k] = dst[i:i + k]
            self.fill += k
            i += k
            if self.fill == self.src.size:
                self._spill()

    def _spill(self) -> None:
        n, self.fill = self.fill, 0
        d, s = _sort_by_dst(self.src[:n], self.dst[:n], reuse_dst=True)
        hi = max(int(d[-1]), int(s.max()))
        i = len(self.files)
        pd, ps = self.work / f"run{i}.dst", self.work / f"run{i}.src"
        with open(pd, "wb") as fd, open(ps, "wb") as fs:
            for lo in range(0, n, _ROWS_PER_WRITE):
                fd.write(_narrow(d[lo:lo + _ROWS_PER_WRITE], hi).data)
                fs.write(_narrow(s[lo:lo + _ROWS_PER_WRITE], hi).data)
        self.files.append((pd, ps, n, np.dtype(np.int32 if hi < 2**31 else np.int64)))

    def finish(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The sorted (dst, src) when no run was written (everything in one buffer), else None."""
        if not self.files:
            out = _sort_by_dst(self.src[:self.fill], self.dst[:self.fill])
            self.src = self.dst = np.empty(0, np.int64)
            return out
        if self.fill:
            self._spill()
        self.src = self.dst = np.empty(0, np.int64)
        return None


class _RunReader:
    """One run read back a block at a time: ``dst[pos:]`` / ``src[pos:]`` are the loaded, unmerged edges."""

    def __init__(self, paths: tuple[Path, Path, int, np.dtype]) -> None:
        pd, ps, self.left, self.dtype = paths
        self.fd, self.fs = open(pd, "rb"), open(ps, "rb")  # noqa: SIM115 - closed by close()
        self.dst = self.src = np.empty(0, self.dtype)
        self.pos = 0

    @property
    def avail(self) -> int:
        return self.dst.size - self.pos

    @property
    def done_reading(self) -> bool:
        return self.left == 0

    def load(self, n: int) -> None:
        """Append up to ``n`` more edges of the run to what is loaded."""
        k = min(n, self.left)
        if k == 0:
            return
        d = np.fromfile(self.fd, self.dtype, k)
        s = np.fromfile(self.fs, self.dtype, k)
        if d.size != k or s.size != k:
            raise OSError(f"a run file of the external sort ended early ({self.fd.name}): was it removed?")
        self.left -= k
        self.dst = np.concatenate([self.dst[self.pos:], d])
        self.src = np.concatenate([self.src[self.pos:], s])
        self.pos = 0

    def take(self, below: int) -> tuple[np.ndarray, np.ndarray]:
        """The loaded edges with ``dst < below`` (consumed)."""
        end = self.pos + int(np.searchsorted(self.dst[self.pos:], below, side="left"))
        out = self.dst[self.pos:end], self.src[self.pos:end]
        self.pos = end
        return out

    def close(self) -> None:
        self.fd.close()
        self.fs.close()


def _merge(files: list[tuple[Path, Path, int, np.dtype]], block: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The runs' edges merged in (dst, run, position) order, as blocks ``(dst, src)`` of whole rows.

    Each step emits every loaded edge whose destination is below ``bound``, the smallest last
    destination among the runs still on disk: no edge left on disk can come before them.  A run
    whose loaded block holds only ``bound`` is read further (a row longer than a block).
    """
    runs = [_RunReader(f) for f in files]
    try:
        while True:
            for r in runs:
                if not r.done_reading and r.avail < block // 2:
                    r.load(block)
            pending = [r for r in runs if not r.done_reading]
            bound = min((int(r.dst[-1]) for r in pending), default=np.iinfo(np.int64).max)
            parts = [r.take(bound) for r in runs if r.avail]
            n = sum(len(d) for d, _ in parts)
            if n == 0:
                if not any(r.avail for r in runs):
                    return
                for r in pending:
                    if r.avail and int(r.dst[r.pos]) == bound:
                        r.load(block)
                continue
            d = np.concatenate([p[0] for p in parts]).astype(np.int64, copy=False)
            s = np.concatenate([p[1] for p in parts])
            yield (d, s) if len(parts) == 1 else _sort_by_dst(s, d, stable_hint=True, reuse_dst=True)
    finally:
        for r in runs:
            r.close()


class _CSRWriter:
    """``indptr.npy`` / ``indices.npy`` written from edges arriving in destination order."""

    def __init__(self, out: Path, num_nodes: int, num_edges: int, idx_dtype: Any) -> None:
        self.indptr = NpyWriter(out / "indptr.npy", (num_nodes + 1,), np.int64)
        self.indices = NpyWriter(out / "indices.npy", (num_edges,), idx_dtype)
        self.indptr.write(np.zeros(1, np.int64))
        self.num_nodes = num_nodes
        self.row = 0     # rows [0, row) are complete in indptr
        self.count = 0   # edges written

    def emit(self, dst: np.ndarray, src: np.ndarray, complete: int | None) -> None:
        """Write ``src`` (sorted by ``dst``); rows below ``complete`` (default ``dst[-1]``) are then complete."""
        self.indices.write(src)
        upto = int(dst[-1]) if complete is None else complete
        for lo in range(self.row, upto, _ROWS_PER_WRITE):
            rows = np.arange(lo, min(lo + _ROWS_PER_WRITE, upto), dtype=np.int64)
            self.indptr.write(self.count + np.searchsorted(dst, rows, side="right"))
        self.count += len(dst)
        self.row = max(self.row, upto)

    def close(self) -> None:
        self.indptr.close()
        self.indices.close()

    def abort(self) -> None:
        self.indptr.abort()
        self.indices.abort()
