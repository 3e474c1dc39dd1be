"""Graphs in: PyTorch Geometric ``Data``, DGL graphs, OGB folders and edge lists (CSV, Parquet, NumPy).

In memory (the data is there already)::

    Graph.from_pyg(data)                    # edge_index -> CSR by destination
    Dataset.from_pyg(data)                  # + x, y, train/val/test masks (or split={"train": ids, ...})

From files, into a dataset directory (`datapath.graph.load_dataset` reads it), out of core:
`import_dataset` (``datapath prepare-dataset --from {pyg,ogb,csv,parquet,npz} SRC OUT``).
The edges become the CSR by an external sort within ``memory`` bytes
(`datapath.graph.external_sort`), the features stream into ``features.npy`` a block of rows at
a time, and the directory is written into a temporary sibling and swapped into place.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from datapath.graph._files import atomic_directory, check_free_space, disk_full, npy_bytes, save_json, save_npy
from datapath.graph.datasets import JSON_MARGIN, Dataset, write_meta
from datapath.graph.errors import DatasetError
from datapath.graph.external_sort import edges_to_csr, read_budget
from datapath.graph.npy_stream import NpyWriter
from datapath.graph.ogb import ogb_source
from datapath.graph.sources import EDGE_LIST_KINDS, Source, edge_list_source
from datapath.graph.tables import Table, check_ids, edge_chunks

log = logging.getLogger("datapath.graph.importers")

KINDS = ("pyg", "ogb", *EDGE_LIST_KINDS)


# -- into a dataset directory --------------------------------------------------------------------
def write_source(src: Source, directory: str | Path, *, memory: int, overwrite: bool = False, seed: int = 0,
                 progress: bool = True) -> Path:
    """Write ``src`` as a dataset directory (or, with neither features nor labels, a graph directory).

    The edges are sorted into the CSR within ``memory`` bytes (`edges_to_csr`); features are
    written as float32 ``features.npy`` and labels as int64 ``labels.npy`` a block at a time.
    Without splits, a random 80/10/10 split of the labelled nodes by ``seed`` (`split_of`).  NaN
    labels (unlabelled nodes) are stored as 0 and may not be in a split.  All into a temporary
    sibling swapped into place.
    """
    if (src.features is None) != (src.labels is None):
        raise DatasetError("give both node features and labels (a dataset), or neither (a graph directory)")
    rows = src.edges.num_rows
    edges = None if rows is None else rows * (1 + src.reverse)
    parent = Path(directory).absolute().parent
    needed = _bytes_needed(src, src.num_nodes, edges)
    with atomic_directory(Path(directory), overwrite, "dataset") as tmp:
        try:
            check_free_space(parent, needed)  # before the sort writes its first run
            _write_source(src, tmp, edges, parent, memory, seed, progress)
        except OSError as exc:
            full = disk_full(exc, Path(directory), needed)
            if full is None:
                raise
            raise full from None
    return Path(directory)


def _bytes_needed(src: Source, num_nodes: int | None, num_edges: int | None) -> int:
    """The most disk `write_source` holds at once for ``src``: the CSR beside the external sort's runs (the
    edges once more, removed once merged) or beside the node files written after them.  A count not known
    yet (None: an edge list in CSV, nodes counted by the sort) counts 0 here; `write_source` checks again
    once the sort has counted them."""
    n, e = num_nodes or 0, num_edges or 0
    item = 4 if n < 2**31 else 8  # the sort's runs and ``indices`` are int32 below 2**31 nodes
    csr = npy_bytes((n + 1,), np.int64) + npy_bytes((e,), np.int32 if item == 4 else np.int64)
    return csr + max(2 * item * e, _node_bytes(src, n)) + JSON_MARGIN


def _node_bytes(src: Source, n: int) -> int:
    """The node files of ``src`` with ``n`` nodes: features (float32), labels and split ids (int64)."""
    if src.features is None:
        return 0
    splits = sum(npy_bytes((len(v),), np.int64) for v in src.splits.values()) if src.splits else \
        npy_bytes((n,), np.int64) + 2 * npy_bytes((0,), np.int64)  # a random split of at most every node
    return npy_bytes((n, src.features.num_cols), np.float32) + npy_bytes((n,), np.int64) + splits


def _write_source(src: Source, tmp: Path, edges: int | None, parent: Path, memory: int, seed: int,
                  progress: bool) -> None:
    """`write_source`'s work, into the temporary directory ``tmp``."""
    csr = edges_to_csr(edge_chunks(src.edges, src.num_nodes, src.reverse), tmp, memory=memory,
                       num_nodes=src.num_nodes, tmp_dir=tmp, progress=progress, total_edges=edges)
    n = csr.num_nodes
    save_json(tmp / "graph.json", {"num_src_nodes": n, "num_dst_nodes": n, "num_edges": csr.num_edges})
    meta = {"name": src.name, "num_nodes": n, "num_edges": csr.num_edges, "source": src.meta,
            "sort": {"runs": csr.runs, "run_s": round(csr.run_s, 3), "merge_s": round(csr.merge_s, 3),
                     "memory": memory}}
    if src.features is not None and src.labels is not None:
        for k, v in (src.splits or {}).items():
            if v.size and int(v.max()) >= n:
                raise DatasetError(f"the {k} split holds node id {int(v.max())} but the graph has {n:,} nodes")
        check_free_space(parent, _node_bytes(src, n) + JSON_MARGIN)  # the sort counted the nodes
        width = _write_features(src.features, tmp / "features.npy", n, read_budget(memory))
        num_classes, unlabelled, labelled = _write_labels(src.labels, tmp / "labels.npy", n, read_budget(memory),
                                                          src.splits)
        if src.splits is None:
            _write_random_split(tmp, seed, labelled)
        else:
            for k, v in src.splits.items():
                save_npy(tmp / f"{k}_idx.npy", v.astype(np.int64))
        write_meta(tmp, {**meta, "num_classes": num_classes, "num_features": width,
                          "unlabelled_nodes": unlabelled,
                          "split": "random 80/10/10" if src.splits is None else "given"})


def split_of(ids: np.ndarray, seed: int) -> np.ndarray:
    """The random split of each node id (0 train, 1 val, 2 test; 80/10/10): a hash of (id, seed), so a split is
    made a block of nodes at a time and is the same for a node whatever the graph's size."""
    x = ids.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
    with np.errstate(over="ignore"):  # splitmix64: wrapping arithmetic
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    u = (x >> np.uint64(11)).astype(np.float64) / 2.0**53
    return (u >= 0.8).astype(np.int8) + (u >= 0.9)


def _write_random_split(d: Path, seed: int, labelled: list[tuple[int, int, np.ndarray]]) -> None:
    """``{train,val,test}_idx.npy`` of the labelled nodes by `split_of`, two passes over blocks of node ids."""
    counts = np.zeros(3, np.int64)
    for first, k, bits in labelled:
        ids = np.arange(first, first + k)[np.unpackbits(bits, count=k).view(bool)]
        counts += np.bincount(split_of(ids, seed), minlength=3)
    writers = [NpyWriter(d / f"{name}_idx.npy", (int(c),), np.int64) for name, c in zip(("train", "val", "test"),
                                                                                       counts)]
    try:
        for first, k, bits in labelled:
            ids = np.arange(first, first + k)[np.unpackbits(bits, count=k).view(bool)]
            which = split_of(ids, seed)
            for i, w in enumerate(writers):
                w.write(ids[which == i])
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _write_features(t: Table, path: Path, n: int, budget: int) -> int:
    if t.num_rows is not None and t.num_rows != n:
        raise DatasetError(f"{t.name} has {t.num_rows:,} rows but the graph has {n:,} nodes: one feature row a node")
    with NpyWriter(path, (n, t.num_cols), np.float32) as w:
        for first, a in t.blocks(budget):
            if first + len(a) > n:
                raise t.error(n, None, f"more feature rows than the graph's {n:,} nodes")
            if a.dtype.kind not in "fiub":
                raise DatasetError(f"{t.name} holds {a.dtype} values; features must be numbers")
            w.write(a)
        if w.rows != n:
            raise DatasetError(f"{t.name} has {w.rows:,} rows but the graph has {n:,} nodes: one feature row a node")
    return t.num_cols


def _write_labels(t: Table, path: Path, n: int, budget: int, splits: dict[str, np.ndarray] | None
                  ) -> tuple[int, int, list[tuple[int, int, np.ndarray]]]:
    """Stream the labels into ``path``; returns (num_classes, nodes without a label, and without ``splits`` which
    nodes have one: ``(first, count, packed bits)`` per block)."""
    if t.num_cols != 1:
        raise DatasetError(f"{t.name} has {t.num_cols} columns; one class label a node is expected (multi-task "
                           f"labels are not supported)")
    if t.num_rows is not None and t.num_rows != n:
        raise DatasetError(f"{t.name} has {t.num_rows:,} rows but the graph has {n:,} nodes: one label a node")
    in_split = np.unique(np.concatenate([v.reshape(-1) for v in splits.values()])) if splits else np.empty(0, np.int64)
    top, unlabelled = -1, 0
    labelled: list[tuple[int, int, np.ndarray]] = []
    with NpyWriter(path, (n,), np.int64) as w:
        for first, a in t.blocks(budget):
            if first + len(a) > n:
                raise t.error(n, None, f"more labels than the graph's {n:,} nodes")
            v = a[:, 0]
            missing = np.isnan(v) if v.dtype.kind == "f" else np.zeros(len(v), bool)
            if missing.any():
                lo, hi = np.searchsorted(in_split, [first, first + len(v)])
                hit = in_split[lo:hi][missing[in_split[lo:hi] - first]]
                if hit.size:
                    raise t.error(int(hit[0]), 0, f"node {int(hit[0])} is in a split but has no label (NaN)")
                unlabelled += int(missing.sum())
                v = np.where(missing, 0, v)
            if splits is None:
                labelled.append((first, len(v), np.packbits(~missing)))
            v = check_ids(t, first, v.reshape(-1, 1), None, "class label")[:, 0]
            if v.size:
                top = max(top, int(v.max()))
            w.write(v)
        if w.rows != n:
            raise DatasetError(f"{t.name} has {w.rows:,} labels but the graph has {n:,} nodes: one label a node")
    if top < 0:
        raise DatasetError(f"{t.name} holds no label")
    return top + 1, unlabelled, labelled


def import_dataset(kind: str, src: str | Path, directory: str | Path, *, memory: int, split: str | None = None,
                   features: str | Path | None = None, labels: str | Path | None = None,
                   num_nodes: int | None = None, header: bool = False, columns: list[str] | None = None,
                   add_reverse_edges: bool = False, name: str | None = None, seed: int = 0,
                   overwrite: bool = False, progress: bool = True) -> Path:
    """Convert ``src`` of kind ``pyg`` / ``ogb`` / ``csv`` / ``parquet`` / ``npz`` into dataset directory ``directory``.

    ``pyg``: a file written by ``torch.save(data)`` (a ``Data``; loaded with pickle: only open
    files you trust).  ``ogb``: an OGB node-property folder (`datapath.graph.ogb`), ``split`` its
    scheme.  ``csv`` / ``parquet`` / ``npz``: an edge list (`datapath.graph.sources.edge_list_source`),
    ``split`` a folder of id files.  ``memory``: bytes for the external sort's buffers and the node
    tables' blocks.  Returns ``directory``.
    """
    if kind not in KINDS:
        raise DatasetError(f"unknown source kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "pyg":
        return _import_pyg(Path(src), directory, name, overwrite)
    if kind == "ogb":
        source = ogb_source(src, split, add_reverse_edges)
    else:
        source = edge_list_source(kind, src, features=features, labels=labels, split=split, num_nodes=num_nodes,
                                  header=header, columns=columns, add_reverse_edges=add_reverse_edges)
    if name:
        source.name = name
    return write_source(source, directory, memory=memory, overwrite=overwrite, seed=seed, progress=progress)


def _import_pyg(p: Path, directory: str | Path, name: str | None, overwrite: bool) -> Path:
    if not p.is_file():
        raise DatasetError(f"{p} is missing (expected a file written by torch.save(data))")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything
        raise DatasetError(f"{p} cannot be loaded with torch.load ({type(exc).__name__}: {exc})") from exc
    if isinstance(obj, tuple) and obj and isinstance(obj[0], dict):  # an InMemoryDataset's processed file
        from torch_geometric.data import Data  # noqa: PLC0415

        obj = Data.from_dict(obj[0])
    ds = Dataset.from_pyg(obj, name=name or p.stem)
    ds.meta["source"] = {"from": "pyg", "path": str(p.absolute())}
    ds.save(directory, overwrite=overwrite)
    return Path(directory)

