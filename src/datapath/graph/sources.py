"""What an import reads: a `Source` (an edge table, node tables, splits) and the readers of its parts.

`edge_list_source` makes one of an edge list (CSV, Parquet, NumPy); `datapath.graph.ogb` makes one of an
OGB folder; `datapath.graph.importers.write_source` writes any of them as a dataset directory.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datapath.graph.errors import DatasetError
from datapath.graph.tables import ArrayTable, CsvTable, EdgeIndexTable, ParquetTable, Table, check_ids

EDGE_LIST_KINDS = ("csv", "parquet", "npz")
_FEATURE_KEYS = ("node_feat", "x", "features", "feat")
_LABEL_KEYS = ("node_label", "y", "labels", "label")
_SPLIT_KEYS = {"train": ("train_idx", "train_mask"), "val": ("val_idx", "valid_idx", "val_mask", "valid_mask"),
               "test": ("test_idx", "test_mask")}


@dataclass
class Source:
    """What `datapath.graph.importers.write_source` writes: an edge table, optional node tables and splits (node
    ids, int64)."""

    name: str
    edges: Table
    num_nodes: int | None = None
    features: Table | None = None
    labels: Table | None = None
    splits: dict[str, np.ndarray] | None = None
    reverse: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


def table_of(path: str | Path, *, integer: bool, header: bool = False) -> Table:
    """A node table (features, labels, ids) in ``.npy``, ``.csv[.gz]``/``.txt``/``.tsv`` or ``.parquet``."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p} is missing")
    suffix = p.suffixes[-2] if p.suffix == ".gz" and len(p.suffixes) > 1 else p.suffix
    if suffix == ".npy":
        return ArrayTable(p)
    if suffix == ".parquet":
        return ParquetTable(p)
    if suffix in (".csv", ".txt", ".tsv"):
        return CsvTable(p, integer=integer, header=header)
    raise DatasetError(f"{p}: unknown table format {suffix!r}; use .npy, .csv, .csv.gz, .txt, .tsv or .parquet")


def read_ids(path: str | Path | Table, num_nodes: int | None) -> np.ndarray:
    """The node ids in a one-column table (a split), int64, checked against ``num_nodes``."""
    t = path if isinstance(path, Table) else table_of(path, integer=True)
    if t.num_cols != 1:
        raise DatasetError(f"{t.name} has {t.num_cols} columns; a list of node ids has one")
    parts = [check_ids(t, first, a, num_nodes, "node id") for first, a in t.blocks(64 << 20)]
    return np.concatenate(parts).reshape(-1) if parts else np.empty(0, np.int64)


def edge_list_source(kind: str, path: str | Path, *, features: str | Path | None = None,
                     labels: str | Path | None = None, split: str | Path | None = None,
                     num_nodes: int | None = None, header: bool = False, columns: list[str] | None = None,
                     add_reverse_edges: bool = False) -> Source:
    """A `Source` for an edge list: ``csv`` (two columns src,dst; ``.gz`` read through gzip), ``parquet``
    (``columns``, default the first two) or ``npz`` (an ``.npz`` with ``edge_index`` and optionally
    ``node_feat``/``x``, ``node_label``/``y``, ``train_idx``/``train_mask``...; or an ``.npy`` (2, E) /
    (E, 2) array).  ``features`` / ``labels``: node tables in files; ``split``: a folder with
    ``train``, ``valid`` (or ``val``) and ``test`` id files (.npy / .csv / .csv.gz)."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p} is missing")
    feats = table_of(features, integer=False) if features is not None else None
    labs = table_of(labels, integer=False) if labels is not None else None
    splits = _split_folder(Path(split), num_nodes) if split is not None else None
    if kind == "csv":
        edges: Table = CsvTable(p, integer=True, header=header, num_cols=2)
    elif kind == "parquet":
        t = ParquetTable(p, columns)
        edges = t if columns else ParquetTable(p, t.columns[:2])
    elif kind == "npz" and p.suffix == ".npy":
        t = ArrayTable(p)
        edges = EdgeIndexTable(p) if t.reader.shape[:1] == (2,) and len(t.reader.shape) == 2 else t
    elif kind == "npz":
        keys = npz_keys(p)
        if "edge_index" not in keys:
            raise DatasetError(f"{p} has no edge_index (2, E) array; it holds {', '.join(sorted(keys))}")
        edges = EdgeIndexTable(p, "edge_index")
        feats = feats or next((ArrayTable(p, k) for k in _FEATURE_KEYS if k in keys), None)
        labs = labs or next((ArrayTable(p, k) for k in _LABEL_KEYS if k in keys), None)
        if splits is None and any(k in keys for keys_ in _SPLIT_KEYS.values() for k in keys_):
            splits = _npz_splits(p, keys)
    else:
        raise DatasetError(f"unknown edge-list kind {kind!r}; one of {', '.join(EDGE_LIST_KINDS)}")
    n = num_nodes if num_nodes is not None else feats.num_rows if feats is not None else None
    return Source(name=p.name.split(".")[0], edges=edges, num_nodes=n, features=feats, labels=labs,
                  splits=splits, reverse=add_reverse_edges,
                  meta={"from": kind, "path": str(p.absolute()), "add_reverse_edges": add_reverse_edges})


def npz_keys(p: Path) -> set[str]:
    """The array names in the ``.npz`` archive ``p``; `DatasetError` naming it when it is not one."""
    try:
        with zipfile.ZipFile(p) as z:
            return {n[:-4] for n in z.namelist() if n.endswith(".npy")}
    except zipfile.BadZipFile as exc:
        raise DatasetError(f"{p} cannot be read as an .npz archive ({exc})") from exc


def _npz_splits(p: Path, keys: set[str]) -> dict[str, np.ndarray]:
    out = {}
    for split, names in _SPLIT_KEYS.items():
        key = next((k for k in names if k in keys), None)
        if key is None:
            raise DatasetError(f"{p} has no {split} split ({' / '.join(names)})")
        t = ArrayTable(p, key)
        if t.dtype == np.bool_:
            out[split] = np.flatnonzero(t.reader.read_all().reshape(-1)).astype(np.int64)
        else:
            out[split] = read_ids(t, None)
    return out


def _split_folder(d: Path, num_nodes: int | None) -> dict[str, np.ndarray]:
    if not d.is_dir():
        raise DatasetError(f"--split {d}: not a folder (it should hold train, valid and test id files)")
    out = {}
    for split, stems in (("train", ("train",)), ("val", ("valid", "val")), ("test", ("test",))):
        found = [p for s in stems for ext in (".npy", ".csv", ".csv.gz", ".txt") if (p := d / f"{s}{ext}").is_file()]
        if not found:
            raise DatasetError(f"{d} has no {split} ids ({'/'.join(stems)}.npy, .csv or .csv.gz)")
        out[split] = read_ids(found[0], num_nodes)
    return out
