"""Datasets by preset name: generated in memory (`get_dataset`) or written to a directory (`prepare_dataset`).

The presets are `datapath.graph.synthetic`'s (``tiny``, ``reddit``, ``products``, ``papers``); a
directory written here is read back by `datapath.graph.load_dataset`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from datapath.graph._files import atomic_directory, check_free_space, named, npy_bytes, reserve, save_npy
from datapath.graph.datasets import JSON_MARGIN, Dataset, load_dataset, named_disk_full, write_meta
from datapath.graph.errors import DatasetError
from datapath.graph.feature_shards import ShardLayout, write_shards
from datapath.graph.graph import Graph
from datapath.graph.synthetic import PRESETS, generate, preset_spec


def prepare_dataset(name: str, directory: str | Path, *, memory_gb: float | None = None, seed: int = 0,
                    device: str | None = None, progress: bool = True, overwrite: bool = False,
                    shards: int | None = None) -> Path:
    """Generate preset ``name`` and write it to ``directory`` (features streamed into a memory-mapped .npy).

    Written like `Dataset.save`: into a temporary sibling, then swapped into place, so an
    interrupted run leaves the old dataset loadable.  A non-empty ``directory`` is replaced
    only with ``overwrite=True``; the check happens before any generation starts.
    ``shards``: cut the features into that many shard files (one per rank of a job that shards
    them, ``train-gnn --shard-features``) instead of one ``features.npy``; the whole table is
    written once first, then split (disk space for twice the features is needed meanwhile).
    """
    spec = preset_spec(name, memory_gb=memory_gb, seed=seed)
    layout = None if shards is None else ShardLayout.even(spec.num_nodes, shards)
    target = Path(directory)
    shape = (spec.num_nodes, spec.num_features)
    needed = npy_bytes(shape, np.float32) * (1 if layout is None else 2)  # refined once the graph is known
    with atomic_directory(target, overwrite, "dataset") as tmp:
        try:
            check_free_space(target.absolute().parent, needed)

            def features_out(graph: Graph) -> np.ndarray:
                nonlocal needed
                needed = _bytes_needed(spec, graph, layout)
                check_free_space(target.absolute().parent, needed)  # before the first byte is written
                path = tmp / "features.npy"
                with named(path):
                    feats = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
                    reserve(path, npy_bytes(shape, np.float32))  # stores into the mapping never meet a full disk
                return feats

            ds = generate(spec, device=device, progress=progress, features_out=features_out)
            feats = ds.features.numpy()
            width = ds.num_features
            if layout is not None:
                write_shards(tmp, feats, layout)
            del feats, ds.features
            if layout is not None:
                (tmp / "features.npy").unlink()
            ds.graph.save(tmp)
            for split in ("labels", "train_idx", "val_idx", "test_idx"):
                save_npy(tmp / f"{split}.npy", getattr(ds, split).numpy())
            write_meta(tmp, {**ds.meta, "name": ds.name, "num_classes": ds.num_classes,
                              "num_nodes": ds.graph.num_nodes, "num_edges": ds.graph.num_edges,
                              "num_features": width}, layout)
        except OSError as exc:
            raise named_disk_full(exc, tmp, target, needed) from None
    return target


def _bytes_needed(spec: Any, graph: Graph, layout: ShardLayout | None) -> int:
    """The bytes of the files `prepare_dataset` writes for ``spec`` with ``graph`` (exact for the arrays; a
    margin for the JSON files); twice the features with shards (the whole table is written first)."""
    n = spec.num_nodes
    n_train, n_val = int(spec.train_frac * n), int(spec.val_frac * n)
    n_test = min(int(spec.test_frac * n), n - n_train - n_val)
    feats = npy_bytes((n, spec.num_features), np.float32)
    if layout is not None:
        feats += feats + 128 * layout.shards
    return (feats + npy_bytes((n + 1,), graph.indptr.numpy().dtype) + npy_bytes((graph.num_edges,),
            graph.indices.numpy().dtype) + npy_bytes((n,), np.int64) + sum(npy_bytes((k,), np.int64)
            for k in (n_train, n_val, n_test)) + JSON_MARGIN)


def get_dataset(name_or_dir: str | Path, *, device: str | None = None, progress: bool = True,
                memory_gb: float | None = None, seed: int = 0) -> Dataset:
    """A dataset directory (loaded, memory-mapped) or a preset name (generated in memory)."""
    p = Path(name_or_dir)
    if p.is_dir():
        return load_dataset(p)
    name = str(name_or_dir)
    if name not in PRESETS and name != "papers":
        raise DatasetError(f"{name!r} is neither a dataset directory nor a preset ({sorted([*PRESETS, 'papers'])})")
    return generate(preset_spec(name, memory_gb=memory_gb, seed=seed), device=device, progress=progress)
