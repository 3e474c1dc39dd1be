"""The disk tier: rows of a `TableFile` read page by page (O_DIRECT), sorted and coalesced, many in flight.

`plan_reads` turns a batch's row ids into reads: ids sorted, each row's byte range mapped
to 4 KiB pages, rows on the same or adjacent pages merged into one read (up to
``max_read_bytes``).  A `DiskReader` runs the reads into a pinned staging buffer:

- ``"aio"``: Linux native AIO, one thread, hundreds of reads in flight (the default);
- ``"threads"``: ``preadv`` from a thread pool (where native AIO is missing);
- ``"kvikio"``: kvikio's ``pread`` (cuFile: GPUDirect Storage where the system has it).

The GPU then copies each row from the staging buffer to its place in the batch (the
memory layer's gather, zero copy).  A failed or short read raises `DiskReadError` naming
the file and the offset; no row of a failed batch is returned.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from datapath.features import _aio
from datapath.features.errors import DiskReadError, FeatureStoreError
from datapath.features.table_file import TableFile
from datapath.features.tiers import FetchTier
from datapath.memory import ErrorFlag, gather_rows, pinned_empty

log = logging.getLogger("datapath.features.disk")

PAGE = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
ENGINES = ("auto", "aio", "threads", "kvikio")


@dataclass
class ReadPlan:
    """Reads for a set of rows: read ``k`` covers ``lengths[k]`` bytes at ``offsets[k]`` into staging byte
    ``staging[k]``; row ``i`` (of the sorted unique ids) lies at staging byte ``row_at[i]``."""

    offsets: np.ndarray
    lengths: np.ndarray
    staging: np.ndarray
    row_at: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def plan_reads(ids: np.ndarray, offset: int, row_bytes: int, max_read_bytes: int = 256 << 10,
               page: int = PAGE, max_gap_pages: int = 0) -> ReadPlan:
    """Page-aligned reads covering rows ``ids`` (sorted, unique int64) of a file whose row 0 is at ``offset``.

    Rows whose pages are at most ``max_gap_pages`` pages apart share a read (0: only rows on the
    same or adjacent pages; a gap is read and thrown away, which pays where one more read costs
    more than the gap's bytes: `datapath.features.scan.choose_gap`).  Reads are split every
    ``max_read_bytes``.
    """
    n = ids.size
    if n == 0:
        empty = np.zeros(0, np.int64)
        return ReadPlan(empty, empty, empty, empty)
    start = offset + ids * row_bytes
    p_lo = start // page
    p_hi = (start + row_bytes - 1) // page
    new = np.ones(n, dtype=bool)
    gap = min(int(max_gap_pages), 1 << 40)
    new[1:] = p_lo[1:] > p_hi[:-1] + 1 + gap  # a gap of more than max_gap_pages pages: a new read
    max_pages = max(1, max_read_bytes // page)
    run = np.cumsum(new) - 1
    bucket = (p_lo - p_lo[new][run]) // max_pages  # split long merged stretches every max_pages pages
    new[1:] |= bucket[1:] != bucket[:-1]
    run = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, n - 1)
    run_lo, run_hi = p_lo[first], p_hi[last]
    pages = run_hi - run_lo + 1
    staging_pages = np.zeros(first.size, np.int64)
    np.cumsum(pages[:-1], out=staging_pages[1:])
    row_at = staging_pages[run] * page + (start - run_lo[run] * page)
    return ReadPlan(run_lo * page, pages * page, staging_pages * page, row_at)


class DiskReader:
    """Runs a `ReadPlan` against one open file (O_DIRECT where the filesystem takes it)."""

    def __init__(self, table: TableFile, engine: str = "auto", depth: int = 256, threads: int = 32) -> None:
        if engine not in ENGINES:
            raise FeatureStoreError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.path = str(table.path)
        self.file_size = table.offset + table.nbytes  # what the file must hold (a shorter file: a short read)
        self.direct = bool(_O_DIRECT)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | _O_DIRECT)
        except OSError:  # tmpfs and a few others refuse O_DIRECT: buffered reads, same results
            self.direct = False
            self.fd = os.open(self.path, os.O_RDONLY)
        self.engine = self._choose(engine, depth)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        log.info("disk tier on %s: engine %s, O_DIRECT %s", self.path, self.engine, "on" if self.direct else "off")

    def _choose(self, engine: str, depth: int) -> str:
        if engine in ("auto", "kvikio"):
            reason = _kvikio_gds()
            if reason is None:
                return "kvikio"
            if engine == "kvikio":
                raise FeatureStoreError(f"engine='kvikio' is not usable here: {reason}")
        if engine in ("auto", "aio"):
            reason = _aio.available()
            if reason is None:
                self._ctx = _aio.AioContext(depth)
                return "aio"
            if engine == "aio":
                raise FeatureStoreError(f"engine='aio' is not usable here: {reason}")
        return "threads"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.close()

    def read(self, plan: ReadPlan, staging: torch.Tensor) -> None:
        """Fill ``staging`` (page-aligned host memory of >= ``plan.nbytes`` bytes) as ``plan`` says."""
        expected = np.clip(self.file_size - plan.offsets, 0, plan.lengths)
        addrs = (np.uint64(staging.data_ptr()) + plan.staging.astype(np.uint64))
        try:
            if self.engine == "aio":
                self._ctx.read(self.fd, plan.offsets, plan.lengths, addrs, expected)
            elif self.engine == "kvikio":
                self._read_kvikio(plan, staging, expected)
            else:
                self._read_threads(plan, staging, expected)
        except _aio.AioError as exc:
            raise DiskReadError(f"reading {self.path} at offset {exc.offset} failed: {exc}; the file is damaged, "
                                f"truncated or on a failing disk (no rows of this batch were returned)",
                                self.path, exc.offset, exc.code) from None

    def _read_threads(self, plan: ReadPlan, staging: torch.Tensor, expected: np.ndarray) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="datapath-disk")
        buf = memoryview(staging.numpy()).cast("B")
        n = plan.offsets.size
        chunks = np.array_split(np.arange(n), min(n, self.threads * 4))

        def run(ks: np.ndarray) -> None:
            for k in ks.tolist():
                off, ln, at, want = (int(plan.offsets[k]), int(plan.lengths[k]), int(plan.staging[k]),
                                     int(expected[k]))
                try:
                    got = os.preadv(self.fd, [buf[at:at + ln]], off)
                except OSError as exc:
                    raise _aio.AioError(f"[Errno {exc.errno}] {exc.strerror}", off, exc.errno) from None
                if got != want:
                    raise _aio.AioError(f"short read: {got} of {want} bytes", off, None)

        for f in [self._pool.submit(run, c) for c in chunks if c.size]:
            f.result()

    def _read_kvikio(self, plan: ReadPlan, staging: torch.Tensor, expected: np.ndarray) -> None:
        import kvikio  # noqa: PLC0415 - optional: only where GPUDirect Storage is present

        with kvikio.CuFile(self.path, "r") as f:
            futures = [(k, f.pread(staging[int(plan.staging[k]):int(plan.staging[k] + plan.lengths[k])],
                                   int(plan.lengths[k]), int(plan.offsets[k])))
                       for k in range(plan.offsets.size)]
            for k, fut in futures:
                got = fut.get()
                if got != int(expected[k]):
                    raise _aio.AioError(f"short read: {got} of {int(expected[k])} bytes", int(plan.offsets[k]), None)


def native_aio_available() -> str | None:
    """None when Linux native AIO (the ``"aio"`` engine) works here, else the reason it does not."""
    return _aio.available()


def _kvikio_gds() -> str | None:
    """None when kvikio imports and reads with GPUDirect Storage (not its POSIX compatibility mode)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import kvikio  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"kvikio does not import ({exc.__class__.__name__})"
    try:
        compat = kvikio.defaults.is_compat_mode_preferred()
    except Exception:  # noqa: BLE001 - newer kvikio: compat_mode() returns an enum
        try:
            compat = str(kvikio.defaults.compat_mode()).upper().endswith("ON")
        except Exception:  # noqa: BLE001
            return "kvikio's compatibility mode cannot be queried"
    return "kvikio runs in POSIX compatibility mode (no GPUDirect Storage)" if compat else None


class DiskTier(FetchTier):
    """Rows of a `TableFile` read on demand (see the module docstring).

    Args:
        table: the file.
        device: where the rows go (cuda: copied by the GPU from pinned staging).
        engine: ``"auto"``, ``"aio"``, ``"threads"`` or ``"kvikio"``.
        depth: reads in flight (native AIO).
        max_read_bytes: longest merged read.
    """

    name = "disk"

    def __init__(self, table: TableFile, device: torch.device, engine: str = "auto", depth: int = 256,
                 max_read_bytes: int = 256 << 10) -> None:
        super().__init__()
        self.table = table
        self.device = device
        self.reader = DiskReader(table, engine, depth)
        self.reader_depth = int(depth)
        self.max_read_bytes = int(max_read_bytes)
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._staging_free: torch.cuda.Event | None = None
        self._lock = threading.Lock()
        self._flag = ErrorFlag()  # the staging copy's own bounds flag (its indices are the tier's, always valid)
        # reads/read_bytes/io_seconds: every read of the tier (row by row and superbatches); staged_rows: rows
        # served from a superbatch's staging; superbatches: one record per superbatch read
        self.stats.extra.update(reads=0, read_bytes=0, io_seconds=0.0, staged_rows=0, staged_missing=0,
                                superbatches=[])
        self._align = int(np.gcd(table.row_bytes, PAGE)) if table.row_bytes else PAGE
        self._r0 = table.offset % self._align

    @property
    def engine(self) -> str:
        return self.reader.engine

    def close(self) -> None:
        self.reader.close()

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """A page-aligned pinned buffer of at least ``nbytes`` (grown by doubling; reused once the GPU is done)."""
        if self._staging_free is not None:
            self._staging_free.synchronize()
        if self._staging.numel() < nbytes + PAGE:
            size = max(nbytes + PAGE, 2 * self._staging.numel(), 1 << 20)
            self._staging = pinned_empty((size,), torch.uint8)
        base = self._staging.data_ptr()
        skip = (-base) % PAGE
        return self._staging[skip:]

    def fetch(self, ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """``out[positions] = table[ids]`` (ids: (k,) int64 in [0, N), any device; positions on ``out``'s device)."""
        if ids.numel() == 0:
            return
        with self._lock:
            t0 = time.perf_counter()
            uniq, inverse = np.unique(ids.cpu().numpy(), return_inverse=True)
            plan = plan_reads(uniq, self.table.offset, self.table.row_bytes, self.max_read_bytes)
            staging = self._staging_for(plan.nbytes)
            self.reader.read(plan, staging)
            io_s = time.perf_counter() - t0
            rows = self._rows_view(staging, plan.nbytes)
            slot = torch.from_numpy((plan.row_at[inverse] - self._r0) // self._align)
            if out.device.type == "cuda":
                self._flag.raise_if_set(" (the disk tier's staging copy: an internal error)")
                got = gather_rows(rows, slot.to(out.device, non_blocking=True), self._flag)
                out.index_copy_(0, positions, got.view(-1, *out.shape[1:]))
                self._staging_free = torch.cuda.Event()
                self._staging_free.record()
            else:
                out.index_copy_(0, positions, rows.index_select(0, slot).view(-1, *out.shape[1:]))
            # the fetch's rows and reads in one update: a reset (any thread) falls wholly before or after it
            self.stats.add(rows=int(ids.numel()), nbytes=int(ids.numel()) * self.table.row_bytes,
                           seconds=time.perf_counter() - t0, reads=int(plan.offsets.size), read_bytes=plan.nbytes,
                           io_seconds=io_s)

    def count_reads(self, reads: int, nbytes: int, io_s: float, superbatch: dict | None = None) -> None:
        """Add reads made for this tier elsewhere (a superbatch's, `datapath.features.superbatch`)."""
        self.stats.add(reads=reads, read_bytes=nbytes, io_seconds=io_s,
                       **({} if superbatch is None else {"superbatches": [superbatch]}))

    def count_staged(self, rows: int, missing: int, seconds: float) -> None:
        """Rows a superbatch served from its staging buffer (``missing``: rows of its batches it lacked)."""
        self.stats.add(rows=rows, nbytes=rows * self.table.row_bytes, seconds=seconds, staged_rows=rows,
                       staged_missing=missing)

    def _rows_view(self, staging: torch.Tensor, used: int) -> torch.Tensor:
        """The staging bytes as overlapping rows: row ``k`` starts at byte ``r0 + k * align``."""
        es = self.table.np_dtype.itemsize
        typed = staging[self._r0: self._r0 + ((used - self._r0) // es) * es].view(self.table.dtype)
        count = max(0, (used - self._r0 - self.table.row_bytes) // self._align + 1)
        rest = tuple(self.table.shape[1:])
        inner = torch.empty(rest, dtype=torch.uint8, device="meta").stride() if rest else ()
        return torch.as_strided(typed, (count, *rest), (self._align // es, *inner))
