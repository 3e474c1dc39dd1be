"""Feature tables cut into shards, one per rank of a job: the layout, the shard files, and reading one shard.

    layout = ShardLayout.even(num_rows, 2)     # shard r holds rows layout.rows(r) = (lo, hi), contiguous
    write_shards(directory, features, layout)  # features.shard-0-of-2.npy, features.shard-1-of-2.npy

A dataset directory written with ``prepare-dataset --shards N`` (`datapath.graph.prepare_dataset`
with ``shards=N``) holds ``N`` shard files instead of ``features.npy``, and ``meta.json`` records
the layout under ``"feature_shards"``.  A rank of an ``N``-rank job then needs only its own shard
file beside the graph, labels and splits (`datapath.graph.load_dataset` with ``shard=(rank, N)``);
the other shards may live on other machines.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datapath.graph._files import load_npy, named, npy_bytes, reserve
from datapath.graph.errors import DatasetError

_CHUNK_BYTES = 256 << 20


def shard_file(shard: int, shards: int) -> str:
    """The file name of shard ``shard`` of ``shards``: ``features.shard-<shard>-of-<shards>.npy``."""
    return f"features.shard-{shard}-of-{shards}.npy"


@dataclass(frozen=True)
class ShardLayout:
    """Rows of an (N, ...) table cut into contiguous ranges: shard ``r`` holds rows ``bounds[r]:bounds[r + 1]``.

    ``bounds`` starts at 0, ends at N and never decreases (a shard may be empty).
    """

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        b = tuple(int(v) for v in self.bounds)
        if len(b) < 2 or b[0] != 0 or any(x > y for x, y in zip(b, b[1:])):
            raise DatasetError(f"shard bounds must start at 0 and never decrease (one more than the shards), "
                               f"got {list(self.bounds)}")
        object.__setattr__(self, "bounds", b)

    @classmethod
    def even(cls, num_rows: int, shards: int) -> "ShardLayout":
        """``shards`` ranges of ``num_rows`` rows whose sizes differ by at most one."""
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise DatasetError(f"the number of shards must be an integer >= 1, got {shards!r}")
        if num_rows < 0:
            raise DatasetError(f"num_rows must be >= 0, got {num_rows}")
        return cls(tuple(r * num_rows // shards for r in range(shards + 1)))

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_rows(self) -> int:
        return self.bounds[-1]

    def rows(self, shard: int) -> tuple[int, int]:
        """``(lo, hi)``: shard ``shard`` holds rows ``lo <= i < hi``."""
        if not 0 <= shard < self.shards:
            raise DatasetError(f"shard {shard} does not exist: the layout has {self.shards} shards")
        return self.bounds[shard], self.bounds[shard + 1]

    def size(self, shard: int) -> int:
        lo, hi = self.rows(shard)
        return hi - lo

    def as_meta(self) -> dict[str, Any]:
        """What ``meta.json`` records (`from_meta` reads it back)."""
        return {"count": self.shards, "bounds": list(self.bounds),
                "files": [shard_file(r, self.shards) for r in range(self.shards)]}

    @classmethod
    def from_meta(cls, meta: Any, where: Path) -> "ShardLayout":
        """The layout recorded in ``meta.json``'s ``"feature_shards"`` (``where`` names the file in errors)."""
        try:
            layout = cls(tuple(meta["bounds"]))
            if int(meta["count"]) != layout.shards:
                raise ValueError(f"count {meta['count']} but {layout.shards} shards in bounds")
        except (KeyError, TypeError, ValueError, DatasetError) as exc:
            raise DatasetError(f"{where} has a bad \"feature_shards\" entry ({exc}); re-create the dataset with "
                               f"prepare-dataset --shards N") from None
        return layout


def write_shards(directory: Path, features: np.ndarray, layout: ShardLayout) -> list[str]:
    """Write the rows of ``features`` (N, F) into one ``.npy`` file per shard of ``layout``; returns their names.

    Copied in chunks of about 256 MiB (``features`` may be a memory map larger than RAM).
    """
    if features.shape[0] != layout.num_rows:
        raise DatasetError(f"a layout of {layout.num_rows} rows cannot shard a table of {features.shape[0]} rows")
    names = []
    row_bytes = max(1, int(np.prod(features.shape[1:], dtype=np.int64)) * features.dtype.itemsize)
    step = max(1, _CHUNK_BYTES // row_bytes)
    for r in range(layout.shards):
        lo, hi = layout.rows(r)
        name = shard_file(r, layout.shards)
        shape = (hi - lo, *features.shape[1:])
        with named(directory / name):
            out = np.lib.format.open_memmap(directory / name, mode="w+", dtype=features.dtype, shape=shape)
            reserve(directory / name, npy_bytes(shape, features.dtype))  # a full disk: an error, not SIGBUS
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            out[a - lo:b - lo] = features[a:b]
        out.flush()
        del out
        names.append(name)
    return names


def read_shard(directory: Path, layout: ShardLayout, shard: int, num_features: int, mmap: bool = True) -> np.ndarray:
    """The rows of shard ``shard`` from its file in ``directory`` (memory-mapped), checked against ``layout``.

    Raises:
        DatasetError: the file is missing, unreadable, or not of shape (rows of the shard, ``num_features``).
    """
    lo, hi = layout.rows(shard)
    p = directory / shard_file(shard, layout.shards)
    if not p.is_file():
        raise DatasetError(f"{p} is missing: shard {shard} of {layout.shards} of the features must lie beside "
                           f"meta.json on the machine that runs rank {shard}; copy it there from the directory "
                           f"prepare-dataset --shards {layout.shards} wrote")
    rows = load_npy(p, mmap)
    if rows.shape != (hi - lo, num_features) or rows.dtype != np.float32:
        raise DatasetError(f"{p} holds a {rows.dtype} array of shape {rows.shape}, but shard {shard} of "
                           f"{layout.shards} must hold rows {lo}..{hi - 1}: float32 ({hi - lo}, {num_features}); "
                           f"the file belongs to another dataset or layout: re-create it with prepare-dataset "
                           f"--shards {layout.shards}")
    return rows


def concat_shards(directory: Path, layout: ShardLayout, num_features: int) -> np.ndarray:
    """The whole (N, F) table read from every shard file into memory (a one-process run of a sharded dataset)."""
    out = np.empty((layout.num_rows, num_features), dtype=np.float32)
    for r in range(layout.shards):
        lo, hi = layout.rows(r)
        out[lo:hi] = read_shard(directory, layout, r, num_features)
    return out


def check_job(layout: ShardLayout, world_size: int, directory: Path) -> None:
    """Raise `DatasetError` unless a job of ``world_size`` ranks matches the ``layout.shards`` prepared shards."""
    if world_size != layout.shards:
        raise DatasetError(f"{directory} holds its features in {layout.shards} shards (prepare-dataset --shards "
                           f"{layout.shards}) but the job has {world_size} ranks: launch {layout.shards} ranks in all "
                           f"(torchrun --nnodes x --nproc-per-node), or prepare the dataset again with --shards "
                           f"{world_size}")
