"""`DiskOptions`: how the disk tier of a `FeatureStore` reads (engine, depth, superbatches)."""
from __future__ import annotations

from dataclasses import dataclass

from datapath.features.scan import BOUNCE_BYTES, DiskCosts


@dataclass(frozen=True)
class DiskOptions:
    """How the disk tier reads: ``engine`` (``"auto"``, ``"aio"``, ``"threads"``, ``"kvikio"``), reads in flight
    (``depth``), the longest merged read of a batch (``max_read_bytes``).

    Superbatches (`datapath.features.superbatch`): ``superbatch`` is the host memory of the staging
    buffers (a budget as for ``host_memory``: ``"10%"`` of the table, ``"4GB"``; None/0: off), taken
    out of ``host_memory`` (the host tier shrinks by it); ``buffers`` splits it in 1 (more batches per
    superbatch) or 2 (the next superbatch read while the current one trains); ``costs``: the disk's
    `DiskCosts` (None: `probe_disk` measures them when the first schedule starts); ``scan_read_bytes``:
    the size of a scan's reads; ``bounce_bytes``: each of the `BOUNCE_BUFFERS` buffers reads go through
    (counted in the staging memory too; at least ``scan_read_bytes``).
    """

    engine: str = "auto"
    depth: int = 256
    max_read_bytes: int = 256 << 10
    superbatch: str | float | int | None = None
    buffers: int = 1
    costs: DiskCosts | None = None
    scan_read_bytes: int = 1 << 20
    bounce_bytes: int = BOUNCE_BYTES
