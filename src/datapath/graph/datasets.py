"""Node-classification datasets: the `Dataset` record and its directory of ``.npy`` files.

A dataset directory holds ``indptr.npy``, ``indices.npy``, ``features.npy``,
``labels.npy``, ``train_idx.npy``, ``val_idx.npy``, ``test_idx.npy`` and ``meta.json``;
`load_dataset` memory-maps it.  `Dataset.from_pyg` / `Dataset.from_dgl` build one from arrays in
memory; `datapath.graph.presets` writes a synthetic preset into a directory, and
`datapath.graph.importers` files in other formats.  Written with ``shards=N``,
the features are cut into ``N`` shard files instead of ``features.npy``
(`datapath.graph.feature_shards`), and ``load_dataset(d, shard=(rank, N))`` reads only one.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath.graph._files import (atomic_directory, check_free_space, check_manifest, disk_full, load_npy,
                                   manifest, save_npy)
from datapath.graph.errors import DatasetError
from datapath.graph.feature_shards import ShardLayout, check_job, concat_shards, read_shard, write_shards
from datapath.graph.graph import Graph
from datapath.memory import host_of

log = logging.getLogger("datapath.graph.datasets")

_FILES = ("indptr.npy", "indices.npy", "features.npy", "labels.npy", "train_idx.npy", "val_idx.npy",
          "test_idx.npy", "meta.json")
_SHARDED_FILES = tuple(f for f in _FILES if f != "features.npy")


@dataclass
class Dataset:
    """A node-classification dataset.

    Attributes:
        graph: the `Graph` (host memory; memory-mapped when loaded from a directory).
        features: (N, F) float32 host tensor; loaded with ``shard=(rank, k)``, only the rows
            ``feature_layout.rows(rank)`` of shard ``feature_shard``.
        labels: (N,) int64 host tensor.
        train_idx / val_idx / test_idx: int64 node ids.
        num_classes: number of label values.
        meta: the spec and generation facts (written to ``meta.json``).
        feature_layout / feature_shard: how the rows are cut into shards, and which shard
            ``features`` holds (None and None: ``features`` is the whole table).
    """

    name: str
    graph: Graph
    features: torch.Tensor
    labels: torch.Tensor
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int
    meta: dict[str, Any] = field(default_factory=dict)
    feature_layout: ShardLayout | None = None
    feature_shard: int | None = None

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    @classmethod
    def from_pyg(cls, data: Any, name: str = "pyg", split: dict[str, Any] | None = None) -> "Dataset":
        """From a PyTorch Geometric ``Data``: ``edge_index``, ``x``, ``y`` and ``train_mask``/``val_mask``/``test_mask``
        (or ``split={"train": ids, "valid": ids, "test": ids}``, as OGB's ``get_idx_split()`` gives)."""
        x, y = getattr(data, "x", None), getattr(data, "y", None)
        if x is None or y is None:
            raise DatasetError(f"the PyG data has no {'x' if x is None else 'y'}; a dataset needs node features (x) "
                               f"and labels (y)")
        splits = split if split is not None else {k: getattr(data, f"{k}_mask", None) for k in ("train", "val", "test")}
        return _from_arrays(name, Graph.from_pyg(data), x, y, splits, {"from": "pyg"})

    @classmethod
    def from_dgl(cls, g: Any, name: str = "dgl", split: dict[str, Any] | None = None) -> "Dataset":
        """From a DGL graph with ``ndata`` ``feat``, ``label`` and ``train_mask``/``val_mask``/``test_mask``."""
        nd = g.ndata
        for k in ("feat", "label"):
            if k not in nd:
                raise DatasetError(f"the DGL graph has no ndata[{k!r}]; a dataset needs node features and labels")
        splits = split if split is not None else {k: nd.get(f"{k}_mask") for k in ("train", "val", "test")}
        return _from_arrays(name, Graph.from_dgl(g), nd["feat"], nd["label"], splits, {"from": "dgl"})

    def save(self, directory: str | Path, *, overwrite: bool = False, shards: int | None = None) -> Path:
        """Write the dataset as a directory of ``.npy`` files plus ``meta.json``, all at once.

        The files are written into a temporary sibling of ``directory``, fsynced, and swapped
        into place: an interrupted save leaves what was there before.  ``meta.json`` records
        every file's size, which `load_dataset` checks.  A non-empty ``directory`` is replaced
        only with ``overwrite=True``.  ``shards``: write the features as that many shard files
        (`datapath.graph.feature_shards`) instead of ``features.npy``.
        """
        if self.feature_shard is not None:
            raise DatasetError("this dataset holds one shard of its features; only a whole dataset can be saved")
        layout = None if shards is None else ShardLayout.even(self.graph.num_nodes, shards)
        target = Path(directory)
        arrays = [self.features, self.labels, self.train_idx, self.val_idx, self.test_idx, self.graph.indptr,
                  self.graph.indices] + ([] if self.graph.edge_ids is None else [self.graph.edge_ids])
        needed = sum(a.numel() * a.element_size() + _NPY_HEADER for a in arrays) + JSON_MARGIN
        with atomic_directory(target, overwrite, "dataset") as tmp:
            try:
                check_free_space(target.absolute().parent, needed)
                self._write(tmp, layout)
            except OSError as exc:
                raise named_disk_full(exc, tmp, target, needed) from None
        return target

    def _write(self, tmp: Path, layout: ShardLayout | None) -> None:
        self.graph.save(tmp)
        feats = host_of(self.features).cpu().numpy()
        if layout is None:
            save_npy(tmp / "features.npy", feats)
        else:
            write_shards(tmp, feats, layout)
        for name in ("labels", "train_idx", "val_idx", "test_idx"):
            save_npy(tmp / f"{name}.npy", host_of(getattr(self, name)).cpu().numpy())
        write_meta(tmp, {**self.meta, "name": self.name, "num_classes": self.num_classes,
                          "num_nodes": self.graph.num_nodes, "num_edges": self.graph.num_edges,
                          "num_features": self.num_features}, layout)


def _from_arrays(name: str, graph: Graph, x: Any, y: Any, splits: dict[str, Any], meta: dict[str, Any]) -> Dataset:
    """A `Dataset` of in-memory arrays: features (N, F), labels (N,) or (N, 1) and the splits (ids or masks)."""
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


def write_meta(d: Path, meta: dict[str, Any], layout: ShardLayout | None = None) -> None:
    """``meta.json`` with the manifest of the files beside it (written last: a directory with it is complete)."""
    names = sorted(p.name for p in d.iterdir() if p.suffix == ".npy" or p.name == "graph.json")
    meta = {k: v for k, v in meta.items() if k != "feature_shards"}
    if layout is not None:
        meta["feature_shards"] = layout.as_meta()
    (d / "meta.json").write_text(json.dumps({**meta, "files": manifest(d, names)}, indent=1))


def load_dataset(directory: str | Path, *, mmap: bool = True, validate: bool = True,
                 shard: tuple[int, int] | None = None) -> Dataset:
    """Load a dataset directory (memory-mapped copy-on-write: features larger than RAM stay on disk).

    Checks what can be checked without reading the features: every file present and of the size
    ``meta.json`` recorded, shapes consistent, split ids and labels in range.  Any problem raises
    `DatasetError` naming the file.

    ``shard=(rank, k)``: load only this rank's rows of the features (the graph, labels and splits
    whole): from its shard file when the directory was written with ``shards=k`` (the other shard
    files need not be there, and ``k`` must match), else rows ``ShardLayout.even(N, k).rows(rank)``
    of ``features.npy`` (only those are read).  Without ``shard``, a sharded directory's shard files
    are read into one (N, F) table in memory.
    """
    d = Path(directory)
    if not d.is_dir():
        stale = sorted(p.name for p in d.parent.glob(f".{d.name}.tmp-*")) if d.parent.is_dir() else []
        hint = (f" (an interrupted prepare-dataset left {', '.join(stale)} beside it: run prepare-dataset again)"
                if stale else f"; run `datapath prepare-dataset NAME {d}` first")
        raise DatasetError(f"{d} is not a directory{hint}")
    meta_path = d / "meta.json"
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
        num_classes = int(meta["num_classes"]) if meta is not None else 0
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{meta_path} is not a dataset description ({exc}); re-create the dataset") from exc
    layout = ShardLayout.from_meta(meta["feature_shards"], meta_path) if meta and "feature_shards" in meta else None
    if shard is not None:
        rank, world = (int(v) for v in shard)
        if not 0 <= rank < world:
            raise DatasetError(f"shard=({rank}, {world}): the rank must lie in [0, {world})")
        if layout is not None:
            check_job(layout, world, d)
    missing = [f for f in (_FILES if layout is None else _SHARDED_FILES) if not (d / f).is_file()]
    if missing:
        raise DatasetError(f"dataset directory {d} lacks {', '.join(missing)}: it is incomplete; re-create it "
                           f"with prepare-dataset")
    if isinstance(meta.get("files"), dict):
        # a rank needs its own shard only (`read_shard` names a missing one)
        skip = set() if layout is None or shard is None else \
            {f for r, f in enumerate(layout.as_meta()["files"]) if r != shard[0] or not (d / f).is_file()}
        check_manifest(d, {k: v for k, v in meta["files"].items() if k not in skip})
    graph = Graph.load(d, mmap=mmap, validate=validate)
    arrays = {n: torch.from_numpy(load_npy(d / f"{n}.npy", mmap))
              for n in ("labels", "train_idx", "val_idx", "test_idx")}
    feats, feature_shard = _load_features(d, meta, layout, graph.num_nodes, shard, mmap)
    if shard is not None:
        layout = layout or ShardLayout.even(graph.num_nodes, shard[1])
    labels = arrays["labels"]
    if labels.shape != (graph.num_nodes,):
        raise DatasetError(f"{d / 'labels.npy'} has shape {tuple(labels.shape)}; expected ({graph.num_nodes},)")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise DatasetError(f"{d / 'labels.npy'} holds {labels.dtype} values; labels must be integers")
    if labels.numel():
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if lo < 0 or hi >= num_classes:
            raise DatasetError(f"{d / 'labels.npy'} holds labels in [{lo}, {hi}] but meta.json says "
                               f"num_classes={num_classes}; every label must lie in [0, {num_classes})")
    for split in ("train_idx", "val_idx", "test_idx"):
        t = arrays[split]
        if t.dim() != 1 or t.dtype.is_floating_point:
            raise DatasetError(f"{d / (split + '.npy')} must be a 1-D integer array, got {t.dtype} "
                               f"{tuple(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= graph.num_nodes):
            raise DatasetError(f"{d / (split + '.npy')} holds node ids outside [0, {graph.num_nodes})")
    return Dataset(meta.get("name", d.name), graph, feats, labels.long(), arrays["train_idx"].long(),
                   arrays["val_idx"].long(), arrays["test_idx"].long(), num_classes, meta,
                   feature_layout=layout if feature_shard is not None else None, feature_shard=feature_shard)


def _load_features(d: Path, meta: dict[str, Any], layout: ShardLayout | None, num_nodes: int,
                   shard: tuple[int, int] | None, mmap: bool) -> tuple[torch.Tensor, int | None]:
    """The (N, F) features, or with ``shard`` this rank's rows; and the shard they are (None: all rows)."""
    if layout is not None:
        if layout.num_rows != num_nodes:
            raise DatasetError(f"{d / 'meta.json'} shards {layout.num_rows} feature rows but the graph has "
                               f"{num_nodes} nodes; re-create the dataset")
        width = int(meta.get("num_features", -1))
        if shard is None:
            log.info("%s: reading its %d feature shards into one table in memory", d, layout.shards)
            table = concat_shards(d, layout, width)
            _check_float(table, d / layout.as_meta()["files"][0])
            return torch.from_numpy(table), None
        part = read_shard(d, layout, shard[0], width, mmap)
        _check_float(part, d / layout.as_meta()["files"][shard[0]])
        return torch.from_numpy(part), shard[0]
    feats = load_npy(d / "features.npy", mmap)
    if feats.ndim != 2 or feats.shape[0] != num_nodes:
        raise DatasetError(f"{d / 'features.npy'} has shape {tuple(feats.shape)}; expected ({num_nodes}, F)")
    _check_float(feats, d / "features.npy")
    if shard is None:
        return torch.from_numpy(feats), None
    lo, hi = ShardLayout.even(num_nodes, shard[1]).rows(shard[0])
    return torch.from_numpy(feats[lo:hi]), shard[0]


def _check_float(feats: np.ndarray, path: Path) -> None:
    """Features are floating point: integer ones (int32/int64, often ids or counts by mistake) are rejected here,
    naming the file, rather than failing once training starts."""
    if not np.issubdtype(feats.dtype, np.floating):
        raise DatasetError(f"{path} holds {feats.dtype} values; node features must be floating point (float32): "
                           f"convert them, e.g. np.save(path, np.load(path).astype(np.float32)), and re-create "
                           f"meta.json with Dataset.save")


def named_disk_full(exc: OSError, tmp: Path, target: Path, needed: int) -> OSError:
    """``exc`` as a `DiskFullError` naming ``target`` (not its temporary sibling) when the disk is full."""
    if exc.filename is not None:
        exc.filename = str(exc.filename).replace(str(tmp), str(target.absolute()))
    full = disk_full(exc, target.absolute().parent, needed)
    return exc if full is None else full


JSON_MARGIN = 64 << 10  # meta.json and graph.json
_NPY_HEADER = 128  # the .npy header of an array of one or two dimensions (np.save pads it to 64-byte lines)
