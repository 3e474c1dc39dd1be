"""The unified tensor's one configuration object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GatherMode = Literal["circular", "shift_mask", "unaligned"]

GATHER_MODES: dict[str, int] = {"unaligned": 0, "shift_mask": 1, "circular": 2}


@dataclass
class UnifiedConfig:
    """Settings of the zero-copy gather/scatter kernels.

    Attributes:
        gather_mode: how the lanes of a warp cover a misaligned row: ``"circular"``
            (PyTorch-Direct's circular shift, the default), ``"shift_mask"`` (DGL's:
            start at the 128-byte line below the row, idle the lanes outside it) or
            ``"unaligned"`` (from the row start).  The last two exist for the ablation.
        sync_bounds_check: after a GPU gather/scatter, wait for the kernel and raise
            ``IndexError`` on the host if an index was out of range (the kernel never
            touches memory outside the table either way).  When False the check does
            not block: out-of-range rows come back as zeros, and the error is raised
            by the next gather/scatter or by ``check_errors()``.
        threads_per_block: CUDA block size of the gather/scatter kernels.
        blocks_per_sm: grid size of the kernels, in blocks per multiprocessor.  Two
            keep enough bytes in flight to cover PCIe latency while leaving most of
            the GPU to kernels that run beside the gather (training on another stream).
        sort_indices: visit the rows in sorted index order (``True``/``False``), or
            ``"auto"``: when at least ``sort_min_rows`` rows are moved from a table of at
            least ``sort_min_table_bytes``.  Random rows of a multi-GB table each cost an
            address-translation miss, which limits rows under ~2 KB far below PCIe
            bandwidth; sorted, neighbouring warps share translations (B1, table sweep).
    """

    gather_mode: GatherMode = "circular"
    sync_bounds_check: bool = True
    threads_per_block: int = 256
    blocks_per_sm: int = 2
    sort_indices: bool | Literal["auto"] = "auto"
    sort_min_rows: int = 4096
    sort_min_table_bytes: int = 256 << 20

    def __setattr__(self, name: str, value: object) -> None:
        if name == "gather_mode" and value not in GATHER_MODES:
            raise ValueError(f"gather_mode must be one of {sorted(GATHER_MODES)}, got {value!r}")
        if name == "blocks_per_sm" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"blocks_per_sm must be a positive int, got {value!r}")
        if name == "threads_per_block" and (not isinstance(value, int) or value % 32 or not 32 <= value <= 1024):
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, 1024], got {value!r}")
        super().__setattr__(name, value)


config = UnifiedConfig()
