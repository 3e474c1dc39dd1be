"""Settings of the row fetch: arguments first, environment variables second, `gather_config` last.

Every setting is an argument of the call that uses it (`datapath.memory.gather_rows`'s
``sync``, ``mode``, ``sort``).  A call that leaves one out takes it from `gather_config`,
whose defaults come from the environment when the process starts:

===================================  =================================================
``DATAPATH_GATHER_SYNC``             ``1``: wait for every gather and raise at once
``DATAPATH_GATHER_MODE``             ``circular`` | ``shift_mask`` | ``unaligned``
``DATAPATH_GATHER_SORT``             ``auto`` | ``1`` | ``0``
``DATAPATH_GATHER_THREADS``          threads per block of the row kernels (256)
``DATAPATH_GATHER_BLOCKS_PER_SM``    grid of those reading host memory (2 per SM)
``DATAPATH_GATHER_LAUNCHER``         ``native`` (default) | ``driver`` | ``cupy``: how a
                                     row kernel is launched
===================================  =================================================

Assigning to `gather_config` (also ``datapath.unified_tensor.config``) changes the default
for the whole process; prefer the arguments.  The variables are read and checked by
`datapath._runtime.settings`; a bad one is reported where a GPU gather is launched (`check_env`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from datapath._runtime import settings

GatherMode = Literal["circular", "shift_mask", "unaligned"]

GATHER_MODES: dict[str, int] = {"unaligned": 0, "shift_mask": 1, "circular": 2}


SORT_METHODS = ("buckets", "buckets_unfused", "torch")
LAUNCHERS = ("native", "driver", "cupy")


@dataclass
class GatherConfig:
    """Settings of the row gather/scatter kernels (`datapath.memory.gather_rows`).

    Attributes:
        gather_mode: how the lanes of a warp cover a misaligned row: ``"circular"``
            (PyTorch-Direct's circular shift, the default), ``"shift_mask"`` (DGL's:
            start at the 128-byte line below the row, idle the lanes outside it) or
            ``"unaligned"`` (from the row start).  The last two exist for the ablation
            (compiled on first use).
        sync_bounds_check: wait for every GPU gather/scatter and raise ``IndexError`` at
            once when an index was out of range.  By default (False) the call does not
            wait: the kernel records a bad index in a pinned host word (it never touches
            memory outside the table; the rows of bad indices come back as zeros) and the
            ``IndexError`` is raised by the next gather/scatter of the same thread, by
            `check_errors`, or by the loader at its next synchronisation.  A call can ask
            for the wait itself (``sync=True``).
        threads_per_block: CUDA block size of the kernels.
        blocks_per_sm: grid of the kernels reading host memory, in blocks per
            multiprocessor.  Two keep enough bytes in flight to cover PCIe latency while
            leaving most of the GPU to kernels running beside the gather (training).
        device_blocks_per_sm: grid of the kernels reading GPU memory (CUDA tables, the
            feature store's GPU cache): HBM wants more requests in flight.
        sort_indices: visit the rows in sorted index order (``True``/``False``), or
            ``"auto"``: when the table is in host memory, has at least ``sort_min_table_bytes``, and the call
            moves at least ``sort_min_rows_short`` rows (and ``sort_min_bytes_short`` bytes) of fewer than
            ``sort_short_row_bytes`` bytes,
            ``sort_min_rows`` rows of fewer than ``sort_max_row_bytes`` bytes, or longer rows: at least
            ``sort_min_rows_long`` of them and ``sort_min_bytes_long`` bytes in all.  Random rows of a
            multi-GB table each cost an address-translation miss, which limits short rows far below
            PCIe bandwidth; sorted, neighbouring warps share translations.  The sort costs tens of
            microseconds of host and GPU time, which only calls of enough rows win back: the
            thresholds are where sorted calls measured faster (CHANGELOG, B1).  Below ~4 MB of short
            rows the sort's host time is near the whole call's GPU time, so a slower host loses
            what the sort saves.
        sort_method: how a sorted visit orders the indices: ``"buckets"`` (the default: a
            counting sort into about one bucket per index, buckets ascending, in one cooperative
            launch; a fraction of ``torch.sort``'s GPU time), ``"buckets_unfused"`` (the same in four
            launches, whose host time an idle GPU waits for; used by ``"buckets"`` where the driver
            refuses a cooperative launch) or ``"torch"`` (``torch.sort``, exact).
        host_window_bytes: the span of table that the rows in flight of a sorted host gather
            of short rows (fewer than ``sort_max_row_bytes``) may cover; a call of sparse rows
            (large table, few rows) gets a smaller grid so that they stay within it (0: the full
            grid always).  Long rows keep the full grid: a row of half a page or more shares its
            translation among its own loads, and more of them in flight read faster.
        host_min_inflight_bytes: the bytes a shrunken grid still keeps in flight (PCIe latency).
        launcher: how a row kernel is launched: ``"native"`` (the plain gather of a known host
            table checked, allocated and launched in one C++ call, `datapath._runtime.native`, built
            on first use in the background; every other launch, and every launch until it is built
            or where it cannot be, as ``"driver"``), ``"driver"`` (``cuLaunchKernelEx`` from one
            prepared buffer through ctypes, the cheapest launch from Python) or ``"cupy"`` (CuPy's
            launcher).
    """

    gather_mode: GatherMode = "circular"
    sync_bounds_check: bool = False
    threads_per_block: int = 256
    blocks_per_sm: int = 2
    device_blocks_per_sm: int = 8
    sort_indices: bool | Literal["auto"] = "auto"
    sort_min_rows_short: int = 8192
    sort_min_bytes_short: int = 4 << 20
    sort_short_row_bytes: int = 1024
    sort_min_rows: int = 32768
    sort_max_row_bytes: int = 2048
    sort_min_rows_long: int = 65536
    sort_min_bytes_long: int = 512 << 20
    sort_min_table_bytes: int = 256 << 20
    sort_method: Literal["buckets", "buckets_unfused", "torch"] = "buckets"
    host_window_bytes: int = 32 << 20
    host_min_inflight_bytes: int = 512 << 10
    launcher: Literal["native", "driver", "cupy"] = "native"
    # bumped by every assignment: what was worked out from the settings is keyed by it
    version: int = field(default=0, compare=False, repr=False)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "gather_mode" and value not in GATHER_MODES:
            raise ValueError(f"gather_mode must be one of {sorted(GATHER_MODES)}, got {value!r}")
        if name in ("blocks_per_sm", "device_blocks_per_sm") and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if name == "threads_per_block" and (not isinstance(value, int) or value % 32 or not 32 <= value <= 1024):
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, 1024], got {value!r}")
        if name == "launcher" and value not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {value!r}")
        if name == "sort_method" and value not in SORT_METHODS:
            raise ValueError(f"sort_method must be one of {SORT_METHODS}, got {value!r}")
        if name in ("host_window_bytes", "host_min_inflight_bytes") and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
        if name == "sort_indices" and value not in (True, False, "auto"):
            raise ValueError(f"sort_indices must be True, False or 'auto', got {value!r}")
        super().__setattr__(name, value)
        if name != "version":
            super().__setattr__("version", self.version + 1)

    def sorts(self, rows: int, row_bytes: int, table_bytes: int, sort: bool | None = None,
              on_host: bool = True) -> bool:
        """Whether a call moving ``rows`` rows of ``row_bytes`` from a table of ``table_bytes`` sorts its indices.

        Only host tables are sorted by the auto rule (their translation misses are what the sort avoids).
        """
        if sort is not None and sort != "auto":
            return bool(sort)
        return rows >= self.sort_from(row_bytes, table_bytes, on_host, sort == "auto")

    def sort_from(self, row_bytes: int, table_bytes: int, on_host: bool = True, auto: bool = False) -> float:
        """The row count from which a call that leaves ``sort`` out sorts its indices (0: every call; inf: none).

        ``auto``: apply the auto rule whatever ``sort_indices`` says.
        """
        choice = "auto" if auto else self.sort_indices
        if choice != "auto":
            return 0.0 if choice else math.inf
        if not on_host or table_bytes < self.sort_min_table_bytes:
            return math.inf
        if row_bytes < self.sort_short_row_bytes:
            return float(max(self.sort_min_rows_short, -(-self.sort_min_bytes_short // max(row_bytes, 1))))
        if row_bytes < self.sort_max_row_bytes:
            return float(self.sort_min_rows)
        return float(max(self.sort_min_rows_long, -(-self.sort_min_bytes_long // max(row_bytes, 1))))


_ENV_ATTRS = (("DATAPATH_GATHER_SYNC", "sync_bounds_check"), ("DATAPATH_GATHER_MODE", "gather_mode"),
              ("DATAPATH_GATHER_SORT", "sort_indices"), ("DATAPATH_GATHER_LAUNCHER", "launcher"),
              ("DATAPATH_GATHER_THREADS", "threads_per_block"), ("DATAPATH_GATHER_BLOCKS_PER_SM", "blocks_per_sm"))


def config_from_env(env: Mapping[str, str] | None = None, strict: bool = True) -> GatherConfig:
    """A `GatherConfig` with the defaults the ``DATAPATH_GATHER_*`` variables of ``env`` (os.environ) ask for.

    A bad value raises `datapath._runtime.settings.SettingError` naming the variable (``strict=False``: it
    is left at its default instead, and `check_env` raises that error where a gather runs)."""
    cfg = GatherConfig()
    for name, attr in _ENV_ATTRS:
        try:
            value = settings.get(name, env)
        except settings.SettingError:
            if strict:
                raise
            continue
        if value is not None:
            setattr(cfg, attr, value)
    return cfg


def check_env() -> None:
    """Raise the `SettingError` of a bad ``DATAPATH_GATHER_*`` variable the process started with (called where
    a GPU gather is launched: a bad setting never fails ``import datapath``)."""
    if _ENV_ERRORS:
        raise settings.SettingError(_ENV_ERRORS[0])


def _env_errors() -> list[str]:
    out = []
    for name in settings.GATHER:
        try:
            settings.get(name)
        except settings.SettingError as exc:
            out.append(str(exc))
    return out


_ENV_ERRORS = _env_errors()
gather_config = config_from_env(strict=False)
