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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath.graph._files import atomic_directory, check_free_space, disk_full, npy_bytes, save_json, save_npy
from datapath.graph.errors import DatasetError
from datapath.graph.external_sort import edges_to_csr, read_budget
from datapath.graph.npy_stream import NpyWriter
from datapath.graph.tables import ArrayTable, CsvTable, EdgeIndexTable, ParquetTable, Table, check_ids, edge_chunks

log = logging.getLogger("datapath.graph.importers")

KINDS = ("pyg", "ogb", "csv", "parquet", "npz")
_FEATURE_KEYS = ("node_feat", "x", "features", "feat")
_LABEL_KEYS = ("node_label", "y", "labels", "label")
_SPLIT_KEYS = {"train": ("train_idx", "train_mask"), "val": ("val_idx", "valid_idx", "val_mask", "valid_mask"),
               "test": ("test_idx", "test_mask")}


# -- in memory ------------------------------------------------------------------------------------
def graph_from_pyg(data: Any) -> Any:
    """`Graph` of a PyG ``Data`` (``edge_index``, ``num_nodes``): row ``v`` lists the sources of edges into ``v``."""
    from datapath.graph.graph import Graph  # noqa: PLC0415

    ei = getattr(data, "edge_index", None)
    if ei is None:
        raise DatasetError(f"{type(data).__name__} has no edge_index; expected a torch_geometric.data.Data")
    return Graph.from_edge_index(ei.cpu(), num_nodes=int(data.num_nodes))


def dataset_from_pyg(data: Any, name: str = "pyg", split: dict[str, Any] | None = None) -> Any:
    """`Dataset` of a PyG ``Data``: ``edge_index``, ``x`` (N, F), ``y`` (N,) or (N, 1) and the splits.

    The splits come from ``split`` (``{"train": ids, "valid" or "val": ids, "test": ids}``, as
    OGB's ``get_idx_split()`` returns) or else from ``data.train_mask`` / ``val_mask`` / ``test_mask``.
    """
    x, y = getattr(data, "x", None), getattr(data, "y", None)
    if x is None or y is None:
        raise DatasetError(f"the PyG data has no {'x' if x is None else 'y'}; a dataset needs node features (x) "
                           f"and labels (y)")
    splits = split if split is not None else {k: getattr(data, f"{k}_mask", None) for k in ("train", "val", "test")}
    return _dataset(name, graph_from_pyg(data), x, y, splits, {"from": "pyg"})


def graph_from_dgl(g: Any) -> Any:
    """`Graph` of a homogeneous DGL graph (``g.edges()``: sources, destinations)."""
    from datapath.graph.graph import Graph  # noqa: PLC0415

    if len(getattr(g, "ntypes", ())) > 1 or len(getattr(g, "canonical_etypes", ())) > 1:
        raise DatasetError("a heterogeneous DGL graph: convert it with dgl.to_homogeneous first")
    src, dst = g.edges()
    return Graph.from_edge_index(torch.stack([src.cpu(), dst.cpu()]), num_nodes=int(g.num_nodes()))


def dataset_from_dgl(g: Any, name: str = "dgl", split: dict[str, Any] | None = None) -> Any:
    """`Dataset` of a DGL graph with ``ndata`` ``feat``, ``label`` and ``train_mask`` / ``val_mask`` / ``test_mask``."""
    nd = g.ndata
    for k in ("feat", "label"):
        if k not in nd:
            raise DatasetError(f"the DGL graph has no ndata[{k!r}]; a dataset needs node features and labels")
    splits = split if split is not None else {k: nd.get(f"{k}_mask") for k in ("train", "val", "test")}
    return _dataset(name, graph_from_dgl(g), nd["feat"], nd["label"], splits, {"from": "dgl"})


def _dataset(name: str, graph: Any, x: Any, y: Any, splits: dict[str, Any], meta: dict[str, Any]) -> Any:
    from datapath.graph.datasets import Dataset  # noqa: PLC0415

    n = graph.num_nodes
    x = torch.as_tensor(x).cpu()
    if x.dim() != 2 or x.shape[0] != n:
        raise DatasetError(f"node features have shape {tuple(x.shape)}; expected ({n}, F)")
    y = torch.as_tensor(y).cpu()
    if y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.shape != (n,):
        raise DatasetError(f"labels have shape {tuple(y.shape)}; expected ({n},) or ({n}, 1): one class a node")
    if y.dtype.is_floating_point:
        if not torch.equal(y, y.round()):
            raise DatasetError("labels hold non-integer values; expected class ids")
        y = y.long()
    if n and int(y.min()) < 0:
        raise DatasetError(f"labels hold {int(y.min())}; class ids must be >= 0")
    ids = {}
    for key in ("train", "val", "test"):
        v = splits.get(key, splits.get("valid") if key == "val" else None)
        if v is None:
            raise DatasetError(f"no {key} split: pass split={{'train': ids, 'valid': ids, 'test': ids}} or give "
                               f"the data {key}_mask")
        v = torch.as_tensor(v).cpu()
        if v.dtype == torch.bool:
            if v.shape != (n,):
                raise DatasetError(f"{key}_mask has shape {tuple(v.shape)}; expected ({n},) (one split; for "
                                   f"several, pass split= with one of them)")
            v = v.nonzero().view(-1)
        if v.numel() and (int(v.min()) < 0 or int(v.max()) >= n):
            raise DatasetError(f"the {key} split holds node ids outside [0, {n})")
        ids[key] = v.long()
    return Dataset(name, graph, x.float().contiguous(), y.long(), ids["train"], ids["val"], ids["test"],
                   int(y.max()) + 1 if n else 0, meta=meta)


# -- from files -----------------------------------------------------------------------------------
@dataclass
class Source:
    """What `write_source` writes: an edge table, optional node tables and splits (node ids, int64)."""

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
        raise DatasetError(f"unknown source kind {kind!r}; one of {', '.join(KINDS)}")
    n = num_nodes if num_nodes is not None else feats.num_rows if feats is not None else None
    return Source(name=p.name.split(".")[0], edges=edges, num_nodes=n, features=feats, labels=labs,
                  splits=splits, reverse=add_reverse_edges,
                  meta={"from": kind, "path": str(p.absolute()), "add_reverse_edges": add_reverse_edges})


def npz_keys(p: Path) -> set[str]:
    """The array names in the ``.npz`` archive ``p``; `DatasetError` naming it when it is not one."""
    import zipfile  # noqa: PLC0415

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
    return csr + max(2 * item * e, _node_bytes(src, n)) + _JSON_MARGIN


def _node_bytes(src: Source, n: int) -> int:
    """The node files of ``src`` with ``n`` nodes: features (float32), labels and split ids (int64)."""
    if src.features is None:
        return 0
    splits = sum(npy_bytes((len(v),), np.int64) for v in src.splits.values()) if src.splits else \
        npy_bytes((n,), np.int64) + 2 * npy_bytes((0,), np.int64)  # a random split of at most every node
    return npy_bytes((n, src.features.num_cols), np.float32) + npy_bytes((n,), np.int64) + splits


_JSON_MARGIN = 64 << 10  # graph.json and meta.json


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
        check_free_space(parent, _node_bytes(src, n) + _JSON_MARGIN)  # the sort counted the nodes
        width = _write_features(src.features, tmp / "features.npy", n, read_budget(memory))
        num_classes, unlabelled, labelled = _write_labels(src.labels, tmp / "labels.npy", n, read_budget(memory),
                                                          src.splits)
        if src.splits is None:
            _write_random_split(tmp, seed, labelled)
        else:
            for k, v in src.splits.items():
                save_npy(tmp / f"{k}_idx.npy", v.astype(np.int64))
        from datapath.graph.datasets import _write_meta  # noqa: PLC0415 - the one writer of meta.json

        _write_meta(tmp, {**meta, "num_classes": num_classes, "num_features": width,
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
    scheme.  ``csv`` / ``parquet`` / ``npz``: an edge list (`edge_list_source`), ``split`` a
    folder of id files.  ``memory``: bytes for the external sort's buffers and the node tables'
    blocks.  Returns ``directory``.
    """
    if kind not in KINDS:
        raise DatasetError(f"unknown source kind {kind!r}; one of {', '.join(KINDS)}")
    if kind == "pyg":
        return _import_pyg(Path(src), directory, name, overwrite)
    if kind == "ogb":
        from datapath.graph.ogb import ogb_source  # noqa: PLC0415 - ogb builds on Source

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
    ds = dataset_from_pyg(obj, name=name or p.stem)
    ds.meta["source"] = {"from": "pyg", "path": str(p.absolute())}
    ds.save(directory, overwrite=overwrite)
    return Path(directory)

