"""OGB node-property datasets read from their folder on disk (no download): raw CSV or processed NPZ layout.

A folder as OGB unpacks it (``dataset/ogbn_products``)::

    raw/edge.csv.gz            E lines "src,dst"          | raw/data.npz: edge_index (2, E),
    raw/num-node-list.csv.gz   one line: N                |   num_nodes_list (1,), node_feat (N, F)
    raw/node-feat.csv.gz       N lines of F numbers       |
    raw/node-label.csv.gz      N lines, one label         | raw/node-label.npz: node_label (N, 1)
    split/<scheme>/{train,valid,test}.csv.gz   one node id a line

Labels may be NaN (nodes without a label, as in ogbn-papers100M); no split node may be one.
Heterogeneous datasets (ogbn-mag) are not read here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from datapath.graph.errors import DatasetError
from datapath.graph.npy_stream import NpyReader
from datapath.graph.sources import Source, npz_keys, read_ids
from datapath.graph.tables import ArrayTable, CsvTable, EdgeIndexTable, Table

SPLITS = {"train": "train", "valid": "val", "test": "test"}


def ogb_source(folder: str | Path, split: str | None = None, add_reverse_edges: bool = False) -> Source:
    """The parts of the OGB node-property dataset in ``folder``, to be written by
    `datapath.graph.importers.write_source`.

    ``split``: the scheme under ``split/`` (default: the only one there).  ``add_reverse_edges``:
    add ``v -> u`` after each ``u -> v`` (OGB's ``add_inverse_edge``; ogbn-products and
    ogbn-proteins store each undirected edge once).
    """
    root = Path(folder)
    raw = root / "raw"
    if not raw.is_dir():
        raise DatasetError(f"{root} is not an OGB dataset folder: it has no raw/ (expected raw/edge.csv.gz or "
                           f"raw/data.npz, and split/<scheme>/)")
    if (raw / "num-node-dict.csv.gz").exists() or (raw / "relations").is_dir():
        raise DatasetError(f"{root} is a heterogeneous OGB dataset (ogbn-mag); only homogeneous node-property "
                           f"datasets can be imported")
    if (raw / "data.npz").is_file():
        layout = "npz"
        num_nodes = _npz_num_nodes(raw / "data.npz")
        edges: Table = EdgeIndexTable(raw / "data.npz", "edge_index")
        features = ArrayTable(raw / "data.npz", "node_feat") if "node_feat" in npz_keys(raw / "data.npz") else None
        labels: Table = ArrayTable(_need(raw / "node-label.npz"), "node_label")
    elif (raw / "edge.csv.gz").is_file():
        layout = "csv"
        counts = CsvTable(_need(raw / "num-node-list.csv.gz"), integer=True)
        num_nodes = _single_count(counts)
        edges = CsvTable(raw / "edge.csv.gz", integer=True, num_cols=2)
        feat = raw / "node-feat.csv.gz"
        features = CsvTable(feat, integer=False) if feat.is_file() else None
        labels = CsvTable(_need(raw / "node-label.csv.gz"), integer=False)
    else:
        raise DatasetError(f"{raw} has neither edge.csv.gz (OGB's CSV layout) nor data.npz (its binary layout)")
    if features is None:
        raise DatasetError(f"{raw} has no node features (node-feat.csv.gz / data.npz:node_feat); a dataset needs "
                           f"them")
    splits = {SPLITS[k]: read_ids(p, num_nodes) for k, p in _split_files(root, split).items()}
    return Source(name=root.name, num_nodes=num_nodes, edges=edges, features=features, labels=labels,
                  splits=splits, reverse=add_reverse_edges,
                  meta={"from": "ogb", "path": str(root.absolute()), "layout": layout,
                        "split": _scheme(root, split), "add_reverse_edges": add_reverse_edges})


def _need(p: Path) -> Path:
    if not p.is_file():
        raise DatasetError(f"{p} is missing; the OGB folder is incomplete")
    return p


def _npz_num_nodes(npz: Path) -> int:
    counts = NpyReader(npz, "num_nodes_list").read_all().reshape(-1)
    if counts.size != 1:
        raise DatasetError(f"{npz}:num_nodes_list lists {counts.size} graphs; a node-property dataset has one")
    return int(counts[0])


def _single_count(table: CsvTable) -> int:
    rows = [a for _, a in table.blocks(1 << 16)]
    vals = np.concatenate(rows).reshape(-1) if rows else np.empty(0, np.int64)
    if vals.size != 1 or vals[0] < 0:
        raise DatasetError(f"{table.name} must hold one non-negative node count, got {vals.tolist()[:4]}")
    return int(vals[0])


def _scheme(root: Path, split: str | None) -> str:
    d = root / "split"
    if not d.is_dir():
        raise DatasetError(f"{root} has no split/ folder (split/<scheme>/train.csv.gz, valid.csv.gz, test.csv.gz)")
    schemes = sorted(p.name for p in d.iterdir() if p.is_dir())
    if split is not None:
        if split not in schemes:
            raise DatasetError(f"{d} has no split {split!r}; it has {', '.join(schemes) or 'none'}")
        return split
    if len(schemes) != 1:
        raise DatasetError(f"{d} holds the splits {', '.join(schemes) or '(none)'}; choose one (--split NAME)")
    return schemes[0]


def _split_files(root: Path, split: str | None) -> dict[str, Path]:
    d = root / "split" / _scheme(root, split)
    return {k: _need(d / f"{k}.csv.gz") for k in SPLITS}
