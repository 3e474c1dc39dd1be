"""Node-classification datasets: the `Dataset` record and its directory of ``.npy`` files.

A dataset directory holds ``indptr.npy``, ``indices.npy``, ``features.npy``,
``labels.npy``, ``train_idx.npy``, ``val_idx.npy``, ``test_idx.npy`` and ``meta.json``;
`load_dataset` memory-maps it.  `prepare_dataset` writes a synthetic preset
(`datapath.graph.synthetic`) into one; `get_dataset` takes either.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath.graph._files import atomic_directory, check_manifest, load_npy, manifest, save_npy
from datapath.graph.errors import DatasetError
from datapath.graph.graph import Graph
from datapath.memory import host_of

log = logging.getLogger("datapath.graph.datasets")

_FILES = ("indptr.npy", "indices.npy", "features.npy", "labels.npy", "train_idx.npy", "val_idx.npy",
          "test_idx.npy", "meta.json")


@dataclass
class Dataset:
    """A node-classification dataset.

    Attributes:
        graph: the `Graph` (host memory; memory-mapped when loaded from a directory).
        features: (N, F) float32 host tensor.
        labels: (N,) int64 host tensor.
        train_idx / val_idx / test_idx: int64 node ids.
        num_classes: number of label values.
        meta: the spec and generation facts (written to ``meta.json``).
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

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write the dataset as a directory of ``.npy`` files plus ``meta.json``, all at once.

        The files are written into a temporary sibling of ``directory``, fsynced, and swapped
        into place: an interrupted save leaves what was there before.  ``meta.json`` records
        every file's size, which `load_dataset` checks.  A non-empty ``directory`` is replaced
        only with ``overwrite=True``.
        """
        with atomic_directory(Path(directory), overwrite, "dataset") as tmp:
            self.graph.save(tmp)
            for name in ("features", "labels", "train_idx", "val_idx", "test_idx"):
                save_npy(tmp / f"{name}.npy", host_of(getattr(self, name)).cpu().numpy())
            _write_meta(tmp, {**self.meta, "name": self.name, "num_classes": self.num_classes,
                              "num_nodes": self.graph.num_nodes, "num_edges": self.graph.num_edges,
                              "num_features": self.num_features})
        return Path(directory)


def _write_meta(d: Path, meta: dict[str, Any]) -> None:
    """``meta.json`` with the manifest of the files beside it (written last: a directory with it is complete)."""
    names = sorted(p.name for p in d.iterdir() if p.suffix == ".npy" or p.name == "graph.json")
    (d / "meta.json").write_text(json.dumps({**meta, "files": manifest(d, names)}, indent=1))


def load_dataset(directory: str | Path, *, mmap: bool = True, validate: bool = True) -> Dataset:
    """Load a dataset directory (memory-mapped copy-on-write: features larger than RAM stay on disk).

    Checks what can be checked without reading the features: every file present and of the size
    ``meta.json`` recorded, shapes consistent, split ids and labels in range.  Any problem raises
    `DatasetError` naming the file.
    """
    d = Path(directory)
    if not d.is_dir():
        stale = sorted(p.name for p in d.parent.glob(f".{d.name}.tmp-*")) if d.parent.is_dir() else []
        hint = (f" (an interrupted prepare-dataset left {', '.join(stale)} beside it: run prepare-dataset again)"
                if stale else f"; run `datapath prepare-dataset NAME {d}` first")
        raise DatasetError(f"{d} is not a directory{hint}")
    missing = [f for f in _FILES if not (d / f).is_file()]
    if missing:
        raise DatasetError(f"dataset directory {d} lacks {', '.join(missing)}: it is incomplete; re-create it "
                           f"with prepare-dataset")
    try:
        meta = json.loads((d / "meta.json").read_text())
        num_classes = int(meta["num_classes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{d / 'meta.json'} is not a dataset description ({exc}); re-create the dataset") from exc
    if isinstance(meta.get("files"), dict):
        check_manifest(d, meta["files"])
    graph = Graph.load(d, mmap=mmap, validate=validate)
    arrays = {n: torch.from_numpy(load_npy(d / f"{n}.npy", mmap))
              for n in ("features", "labels", "train_idx", "val_idx", "test_idx")}
    feats = arrays["features"]
    if feats.dim() != 2 or feats.shape[0] != graph.num_nodes:
        raise DatasetError(f"{d / 'features.npy'} has shape {tuple(feats.shape)}; expected ({graph.num_nodes}, F)")
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
                   arrays["val_idx"].long(), arrays["test_idx"].long(), num_classes, meta)


def prepare_dataset(name: str, directory: str | Path, *, memory_gb: float | None = None, seed: int = 0,
                    device: str | None = None, progress: bool = True, overwrite: bool = False) -> Path:
    """Generate preset ``name`` and write it to ``directory`` (features streamed into a memory-mapped .npy).

    Written like `Dataset.save`: into a temporary sibling, then swapped into place, so an
    interrupted run leaves the old dataset loadable.  A non-empty ``directory`` is replaced
    only with ``overwrite=True``; the check happens before any generation starts.
    """
    from datapath.graph.synthetic import generate, preset_spec  # noqa: PLC0415 - synthetic builds on Dataset

    spec = preset_spec(name, memory_gb=memory_gb, seed=seed)
    with atomic_directory(Path(directory), overwrite, "dataset") as tmp:
        feats = np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.float32,
                                          shape=(spec.num_nodes, spec.num_features))
        ds = generate(spec, device=device, progress=progress, features_out=feats)
        feats.flush()
        del feats
        ds.graph.save(tmp)
        for split in ("labels", "train_idx", "val_idx", "test_idx"):
            save_npy(tmp / f"{split}.npy", getattr(ds, split).numpy())
        _write_meta(tmp, {**ds.meta, "name": ds.name, "num_classes": ds.num_classes,
                          "num_nodes": ds.graph.num_nodes, "num_edges": ds.graph.num_edges,
                          "num_features": ds.num_features})
    return Path(directory)


def get_dataset(name_or_dir: str | Path, *, device: str | None = None, progress: bool = True,
                memory_gb: float | None = None, seed: int = 0) -> Dataset:
    """A dataset directory (loaded, memory-mapped) or a preset name (generated in memory)."""
    from datapath.graph.synthetic import PRESETS, generate, preset_spec  # noqa: PLC0415

    p = Path(name_or_dir)
    if p.is_dir():
        return load_dataset(p)
    name = str(name_or_dir)
    if name not in PRESETS and name != "papers":
        raise DatasetError(f"{name!r} is neither a dataset directory nor a preset ({sorted([*PRESETS, 'papers'])})")
    return generate(preset_spec(name, memory_gb=memory_gb, seed=seed), device=device, progress=progress)
