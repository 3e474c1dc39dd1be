"""Building a feature store's tiers: the slot map, and filling the GPU cache and host tier from a file in one pass.

Private to `datapath.features`.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from datapath.features.errors import DiskReadError, FeatureStoreError
from datapath.features.table_file import TableFile

MAX_SLOTS = 2**31 - 2


def slot_map(n: int, cache_ids: torch.Tensor, host_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(n,) int32: slot ``1..C`` for the cached rows (in ``cache_ids`` order), ``C+1..`` for host rows, -1 for disk.

    ``host_ids`` None: the host tier is the whole table in row order (slot ``C + 1 + id``);
    otherwise it holds rows ``host_ids`` in that order and every other uncached row is on disk.
    """
    c = cache_ids.numel()
    h = n if host_ids is None else host_ids.numel()
    if c + h > MAX_SLOTS:
        raise FeatureStoreError(f"a table of {n:,} rows needs more than 2^31 slots; split it into several stores")
    if host_ids is None:
        slots = torch.arange(c + 1, c + 1 + n, dtype=torch.int32, device=device)
    else:
        slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        slots[host_ids.to(device)] = torch.arange(c + 1, c + 1 + h, dtype=torch.int32, device=device)
    if c:
        slots[cache_ids.to(device)] = torch.arange(1, c + 1, dtype=torch.int32, device=device)
    return slots


def _read_exactly(fd: int, buf: np.ndarray, offset: int, path: str) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < view.nbytes:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise DiskReadError(f"reading {path} at offset {offset + done} failed: [Errno {exc.errno}] "
                                f"{exc.strerror}", path, offset + done, exc.errno) from None
        if got <= 0:
            raise DiskReadError(f"short read from {path} at offset {offset + done}: the file ended early "
                                f"(truncated while open?)", path, offset + done)
        done += got


def fill_from_file(table: TableFile, slots: np.ndarray, n_cache: int, cache: torch.Tensor | None,
                   host: torch.Tensor | None, chunk_bytes: int = 256 << 20, threads: int = 4) -> None:
    """One sequential pass over ``table``: each row goes to ``cache[slot - 1]`` or ``host[slot - 1 - n_cache]``.

    ``slots``: (N,) int32 numpy (see `slot_map`); rows with slot < 1 are skipped.  Reads are
    buffered (served from the page cache when the file is there) and run ``threads`` ahead.
    """
    n, rb = table.num_rows, table.row_bytes
    if n == 0 or rb == 0:
        return
    per = max(1, chunk_bytes // rb)
    spans = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
    fd = os.open(table.path, os.O_RDONLY)
    rest = tuple(table.shape[1:])

    def read(span: tuple[int, int]) -> np.ndarray:
        lo, hi = span
        buf = np.empty((hi - lo) * rb, dtype=np.uint8)
        _read_exactly(fd, buf, table.offset + lo * rb, str(table.path))
        return buf

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="datapath-fill") as pool:
            pending = [pool.submit(read, s) for s in spans[:threads]]
            for i, (lo, hi) in enumerate(spans):
                buf = pending[i].result()
                if i + threads < len(spans):
                    pending.append(pool.submit(read, spans[i + threads]))
                pending[i] = None  # type: ignore[call-overload]  # free the chunk once used
                rows = torch.from_numpy(buf).view(table.dtype).view(hi - lo, *rest)
                s = torch.from_numpy(slots[lo:hi]).long()
                if cache is not None and n_cache:
                    pos = ((s >= 1) & (s <= n_cache)).nonzero().squeeze(1)
                    if pos.numel():
                        cache.index_copy_(0, (s[pos] - 1).to(cache.device), rows[pos].to(cache.device))
                if host is not None:
                    pos = (s > n_cache).nonzero().squeeze(1)
                    if pos.numel():
                        host.index_copy_(0, s[pos] - 1 - n_cache, rows[pos])
    finally:
        os.close(fd)
