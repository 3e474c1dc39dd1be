"""Reading many rows of a `TableFile` at once: what the disk costs, which reads to issue, and the reads themselves.

A superbatch (`datapath.features.superbatch`) needs millions of rows of a file at once.
Whether to read only their pages (sorted random 4 KiB reads) or to read the whole
stretch of the file they lie in, in large sequential O_DIRECT reads, and throw the rest
away, depends on the disk:

- `probe_disk` measures it on the file itself: random 4 KiB reads per second with many in
  flight (``fio --rw=randread --bs=4k``), and the bandwidth of large sequential reads;
- `choose_gap` predicts, from those numbers, the time of each way of covering the rows
  (merging rows whose pages lie at most ``G`` pages apart, from ``G = 0``, random reads,
  to one scan) and picks the fastest;
- `read_rows` runs the chosen reads through a few bounce buffers, a reader thread each (`run_groups`:
  while one copies the wanted rows out of its buffer, the others' reads are in flight), into a
  compact buffer, row ``i`` for ``ids[i]``.

A failed or short read raises `DiskReadError` naming the file and the offset.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from datapath.features.disk import PAGE, DiskReader, ReadPlan, plan_reads
from datapath.features.errors import FeatureStoreError
from datapath.features.table_file import TableFile

SCAN = 1 << 40
"""``max_gap_pages`` of one scan: every gap is read."""

BOUNCE_BYTES = 32 << 20
"""Each bounce buffer of `read_rows` (and of `probe_disk`'s sequential reads)."""

BOUNCE_BUFFERS = 4
"""Bounce buffers (and reader threads) of `read_rows`: while one unpacks, the others' reads are in flight."""


GAPS = (0, 1, 3, 7, 15, 63, 255, SCAN)
"""The ways `choose_gap` compares: rows whose pages are at most G pages apart share a read."""


@dataclass(frozen=True)
class DiskCosts:
    """What reads cost on one file: random 4 KiB reads per second (``iops``, many in flight) and the
    bandwidth of sequential reads of ``seq_read_bytes`` (``seq_GBps``), measured by `probe_disk`."""

    iops: float
    seq_GBps: float
    seq_read_bytes: int = 1 << 20
    direct: bool = True
    engine: str = "aio"
    detail: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def random_GBps(self) -> float:
        return self.iops * PAGE / 1e9

    def predict(self, reads: int, nbytes: int) -> float:
        """Seconds for ``reads`` reads of ``nbytes`` in all: the reads' cost (at the random 4 KiB rate) plus the
        bytes' (at the sequential rate).  Cautious for reads of middle sizes, which the probe does not measure
        (within 13% of the probe at its two ends)."""
        return reads / self.iops + nbytes / (self.seq_GBps * 1e9)

    def as_dict(self) -> dict[str, Any]:
        return {"iops": self.iops, "random_GBps": self.random_GBps, "seq_GBps": self.seq_GBps,
                "seq_read_bytes": self.seq_read_bytes, "direct": self.direct, "engine": self.engine, **self.detail}


def _aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 host buffer of ``nbytes`` (O_DIRECT reads need aligned memory)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + nbytes]


def probe_disk(table: TableFile, *, random_reads: int = 60_000, depths: tuple[int, ...] = (64, 256, 1024),
               seq_bytes: int = 2 << 30, seq_read_bytes: int = 1 << 20, engine: str = "auto",
               seed: int = 0, bounce_bytes: int | None = None) -> DiskCosts:
    """Measure ``table``'s file: random 4 KiB reads at each depth in ``depths`` (the best is ``iops``), and
    ``seq_bytes`` read sequentially (from a random page, wrapping) in ``seq_read_bytes`` reads, as
    `read_rows` reads a scan.  O_DIRECT where the filesystem takes it (``direct`` says)."""
    size = table.path.stat().st_size
    pages = max(1, size // PAGE)
    rng = np.random.default_rng(seed)
    buf = _aligned(random_reads * PAGE)
    by_depth: dict[int, dict[str, float]] = {}
    reader = None
    for depth in depths:
        reader = DiskReader(table, engine, depth=depth)
        offs = rng.integers(0, pages, random_reads).astype(np.int64) * PAGE
        lengths = np.full(random_reads, PAGE, np.int64)
        plan = ReadPlan(offs, lengths, np.arange(random_reads, dtype=np.int64) * PAGE, np.zeros(0, np.int64))
        t0 = time.perf_counter()
        reader.read(plan, buf)
        dt = time.perf_counter() - t0
        by_depth[depth] = {"GBps": random_reads * PAGE / dt / 1e9, "iops": random_reads / dt}
        if depth != depths[-1]:
            reader.close()
    assert reader is not None
    del buf
    n = max(1, min(seq_bytes, size) // seq_read_bytes)
    first = int(rng.integers(0, max(1, pages - n * (seq_read_bytes // PAGE)))) * PAGE
    offs = first + np.arange(n, dtype=np.int64) * seq_read_bytes
    lengths = np.full(n, seq_read_bytes, np.int64)
    plan = ReadPlan(offs, lengths, np.arange(n, dtype=np.int64) * seq_read_bytes, np.zeros(0, np.int64))
    bounce = [_aligned(bounce_bytes or BOUNCE_BYTES) for _ in range(BOUNCE_BUFFERS)]
    readers = [reader] + [DiskReader(table, engine, depth=depths[-1]) for _ in range(BOUNCE_BUFFERS - 1)]
    seq_s = run_groups(readers, plan, bounce)
    for r in readers:
        r.close()
    iops = max(v["iops"] for v in by_depth.values())
    return DiskCosts(iops=iops, seq_GBps=n * seq_read_bytes / seq_s / 1e9, seq_read_bytes=seq_read_bytes,
                     direct=reader.direct, engine=reader.engine,
                     detail={"random_reads": random_reads, "by_depth": by_depth, "seq_bytes": n * seq_read_bytes,
                             "seq_s": seq_s})


@dataclass
class GapChoice:
    """The reads `choose_gap` picked: ``max_gap_pages`` (0: only needed pages, `SCAN`: one scan), with its predicted
    ``reads``, ``nbytes`` and ``seconds``, and every candidate's prediction (``candidates``)."""

    max_gap_pages: int
    reads: int
    nbytes: int
    seconds: float
    candidates: list[dict[str, Any]]

    @property
    def mode(self) -> str:
        """``"pages"`` (only the needed pages, adjacent ones in one read: random reads where the rows are
        sparse), ``"scan"`` (the whole stretch), or ``"gaps<=G"`` (gaps of up to G pages read too)."""
        return "pages" if self.max_gap_pages == 0 else "scan" if self.max_gap_pages >= SCAN else \
            f"gaps<={self.max_gap_pages}"


def choose_gap(ids: np.ndarray, offset: int, row_bytes: int, costs: DiskCosts, max_read_bytes: int = 1 << 20,
               random_read_bytes: int = 256 << 10) -> GapChoice:
    """The fastest way, by ``costs``, to read rows ``ids`` (sorted unique int64) of a file whose row 0 is at
    ``offset``: for each G of `GAPS`, the reads (runs of pages with gaps of at most G pages, split
    every ``max_read_bytes``; ``random_read_bytes`` for G = 0) and the bytes they read."""
    if ids.size == 0:
        return GapChoice(0, 0, 0, 0.0, [])
    start = offset + ids * row_bytes
    p_lo = start // PAGE
    p_hi = (start + row_bytes - 1) // PAGE
    gaps = np.maximum(p_lo[1:] - p_hi[:-1] - 1, 0)
    span = int(p_hi[-1] - p_lo[0] + 1)
    top = max(g for g in GAPS if g < SCAN) + 1
    clipped = np.minimum(gaps, top)
    count = np.bincount(clipped, minlength=top + 1)  # gaps of each length (the last: longer ones)
    pages_in = np.bincount(clipped, weights=gaps, minlength=top + 1)  # and their pages
    total_gap = float(pages_in.sum())
    out: list[dict[str, Any]] = []
    for g in GAPS:
        g_ = min(g, top)
        read_gaps = int(count[: g_ + 1].sum()) if g < SCAN else gaps.size  # gaps <= g are read
        runs = 1 + gaps.size - read_gaps
        pages = span - int(round(total_gap - (pages_in[: g_ + 1].sum() if g < SCAN else total_gap)))
        cap = (random_read_bytes if g == 0 else max_read_bytes) // PAGE
        reads = max(runs, math.ceil(pages / max(cap, 1)))
        out.append({"max_gap_pages": g, "reads": reads, "bytes": pages * PAGE,
                    "seconds": costs.predict(reads, pages * PAGE)})
    best = min(out, key=lambda c: c["seconds"])
    return GapChoice(best["max_gap_pages"], best["reads"], best["bytes"], best["seconds"], out)


def _group_bounds(plan: ReadPlan, cap: int) -> list[tuple[int, int]]:
    """Consecutive reads ``a:b`` of ``plan`` whose bytes fit ``cap``."""
    n = plan.offsets.size
    ends = plan.staging + plan.lengths
    out, a = [], 0
    while a < n:
        b = int(np.searchsorted(ends, plan.staging[a] + cap, side="right"))
        if b <= a:
            raise FeatureStoreError(f"a read of {int(plan.lengths[a])} bytes does not fit the {cap}-byte bounce buffer")
        out.append((a, b))
        a = b
    return out


def run_groups(readers: list[DiskReader], plan: ReadPlan, bounce: list[torch.Tensor],
               consume: Callable[[int, int, torch.Tensor], None] | None = None,
               stop: threading.Event | None = None) -> float:
    """Run ``plan`` in groups of reads that fit a bounce buffer: worker ``w`` (a thread with ``readers[w]`` and
    ``bounce[w]``) reads groups ``w, w + W, ...`` into its buffer and hands each to ``consume(a, b, buffer)``
    (reads ``a:b``), so that the disk always has the groups of the other workers in flight while one
    unpacks.  Returns the wall seconds.  The first error (`DiskReadError`) stops every worker and is raised;
    ``stop`` ends the reads early."""
    if len(readers) != len(bounce):
        raise FeatureStoreError(f"one reader per bounce buffer: {len(readers)} readers, {len(bounce)} buffers")
    groups = _group_bounds(plan, min(int(b.numel()) for b in bounce))
    halt = threading.Event()
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for a, b in groups[w::len(bounce)]:
                if halt.is_set() or (stop is not None and stop.is_set()):
                    return
                base = int(plan.staging[a])
                sub = ReadPlan(plan.offsets[a:b], plan.lengths[a:b], plan.staging[a:b] - base, plan.row_at[:0])
                readers[w].read(sub, bounce[w])
                if consume is not None:
                    consume(a, b, bounce[w])
        except BaseException as exc:  # noqa: BLE001 - raised by the caller
            errors.append(exc)
            halt.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(w,), name=f"datapath-read-{w}", daemon=True)
               for w in range(min(len(bounce), len(groups)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _word(row_bytes: int, align: int, r0: int) -> torch.dtype:
    for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % w == 0 and align % w == 0 and r0 % w == 0:
            return dt
    return torch.uint8


@dataclass
class ReadResult:
    """What `read_rows` did: ``reads`` and ``read_bytes`` issued, ``io_s`` spent in them, ``seconds`` in all."""

    reads: int
    read_bytes: int
    io_s: float
    seconds: float


def plan_rows(table: TableFile, ids: np.ndarray, max_gap_pages: int, max_read_bytes: int = 1 << 20,
              bounce_bytes: int = BOUNCE_BYTES) -> ReadPlan:
    """The `plan_reads` of `read_rows`: reads of at most ``max_read_bytes`` (256 KiB when ``max_gap_pages`` is 0),
    each within a bounce buffer of ``bounce_bytes``."""
    rb = table.row_bytes
    row_pages = -(-rb // PAGE) + 1  # a read runs past its cap by at most the pages of its last row
    cap = min(max_read_bytes if max_gap_pages else min(max_read_bytes, 256 << 10), bounce_bytes - row_pages * PAGE)
    if cap < PAGE:
        raise FeatureStoreError(f"bounce buffers of {bounce_bytes} bytes are too small for {rb}-byte rows; give "
                                f"at least {(row_pages + 1) * PAGE} bytes")
    return plan_reads(ids, table.offset, rb, cap, max_gap_pages=max_gap_pages)


def read_rows(readers: DiskReader | list[DiskReader], table: TableFile, ids: np.ndarray, out: torch.Tensor,
              max_gap_pages: int, max_read_bytes: int = 1 << 20, bounce: list[torch.Tensor] | None = None,
              stop: threading.Event | None = None, plan: ReadPlan | None = None) -> ReadResult:
    """``out[i] = bytes of row ids[i]`` for sorted unique ``ids``: ``out`` is (len(ids), row_bytes) uint8 CPU memory.

    The reads are `plan_rows` (``max_gap_pages``, ``max_read_bytes``; or ``plan``, made by it
    beforehand) run by `run_groups`: one worker per ``bounce`` buffer (page-aligned, equal; default
    `BOUNCE_BUFFERS` of `BOUNCE_BYTES`) and reader, each copying the wanted rows out of its buffer
    while the others' reads are in flight.  ``io_s`` is the wall time of the reads (unpacking
    overlapped).  Raises `DiskReadError` (file and offset) on a failed or short read; ``out`` is
    then incomplete (also when ``stop`` is set, which ends the reads early).
    """
    t_all = time.perf_counter()
    rb = table.row_bytes
    if out.dtype != torch.uint8 or out.shape != (ids.size, rb) or not out.is_contiguous():
        raise FeatureStoreError(f"out must be a contiguous ({ids.size}, {rb}) uint8 tensor, got {out.dtype} "
                                f"{tuple(out.shape)}")
    if ids.size == 0:
        return ReadResult(0, 0, 0.0, 0.0)
    if bounce is None:
        bounce = [_aligned(BOUNCE_BYTES) for _ in range(BOUNCE_BUFFERS)]
    readers = list(readers) if isinstance(readers, (list, tuple)) else [readers]
    if len(readers) < len(bounce):
        bounce = bounce[: len(readers)]
    if plan is None:
        plan = plan_rows(table, ids, max_gap_pages, max_read_bytes, int(bounce[0].numel()))
    align = math.gcd(rb, PAGE)
    r0 = table.offset % align
    word = _word(rb, align, r0)
    ws = torch.empty((), dtype=word).element_size()
    out_w = out.view(word)

    def unpack(a: int, b: int, buf: torch.Tensor) -> None:
        base = int(plan.staging[a])
        ra = int(np.searchsorted(plan.row_at, base, side="left"))
        rb_ = int(np.searchsorted(plan.row_at, int(plan.staging[b - 1] + plan.lengths[b - 1]), side="left"))
        local = plan.row_at[ra:rb_] - base
        words = buf.view(word)
        count = (buf.numel() - r0 - rb) // align + 1
        rows = torch.as_strided(words, (count, rb // ws), (align // ws, 1), words.storage_offset() + r0 // ws)
        torch.index_select(rows, 0, torch.from_numpy((local - r0) // align), out=out_w[ra:rb_])

    io_s = run_groups(readers[: len(bounce)], plan, bounce, unpack, stop)
    return ReadResult(int(plan.offsets.size), plan.nbytes, io_s, time.perf_counter() - t_all)
