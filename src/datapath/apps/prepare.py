"""``datapath prepare-dataset --from {pyg,ogb,csv,parquet,npz} SRC OUT``: a user's graph into a dataset directory.

The arguments are added to the ``prepare-dataset`` parser of `datapath.apps.cli`; the work is
`datapath.graph.import_dataset`.  ``--memory`` bounds the whole command's resident memory:
the external sort and the node tables get what the process does not hold already.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from datapath.graph import IMPORT_KINDS, import_dataset

DEFAULT_MEMORY = "25%"
#: Resident memory kept free for what the budget does not count (allocator slack, tqdm, small arrays).
_SLACK = 16 << 20


def add_import_arguments(q: Any) -> None:
    """The ``--from`` family of options, on the ``prepare-dataset`` parser ``q``."""
    q.add_argument("--from", dest="source_kind", choices=IMPORT_KINDS, default=None, metavar="KIND",
                   help="import a graph instead of generating a preset: NAME is then the source SRC. pyg: a file "
                        "written by torch.save(data) (unpickled: only files you trust); ogb: an OGB node-property "
                        "folder (raw/ + split/, CSV or NPZ layout, no download); csv / parquet / npz: an edge list "
                        "(src,dst rows; an .npz with edge_index [x, y, *_mask], or an .npy (2, E) / (E, 2))")
    q.add_argument("--memory", default=None, metavar="SIZE",
                   help=f"with --from: resident memory the whole command may use ('4GB', '25%%' of RAM): edge "
                        f"lists larger than it are sorted on disk in runs [{DEFAULT_MEMORY.replace('%', '%%')}]")
    q.add_argument("--split", default=None, metavar="NAME|DIR",
                   help="with --from ogb: the split scheme under split/ [the only one]; csv/parquet/npz: a folder "
                        "with train, valid (or val) and test id files (.npy, .csv, .csv.gz) [random 80/10/10 by "
                        "--seed]")
    q.add_argument("--features", type=Path, default=None, metavar="FILE",
                   help="with --from csv/parquet/npz: node features, one row a node (.npy, .csv[.gz], .parquet)")
    q.add_argument("--labels", type=Path, default=None, metavar="FILE",
                   help="with --from csv/parquet/npz: one class id a node (.npy, .csv[.gz], .parquet); without "
                        "--features and --labels an edge list becomes a graph directory (Graph.load)")
    q.add_argument("--num-nodes", type=int, default=None, metavar="N",
                   help="node count of an edge list [the features' rows, else the largest id + 1]")
    q.add_argument("--header", action="store_true", help="with --from csv: skip the first line (column names)")
    q.add_argument("--columns", default=None, metavar="SRC,DST",
                   help="with --from parquet: the source and destination columns [the first two]")
    q.add_argument("--add-reverse-edges", action="store_true",
                   help="add v->u after each edge u->v (OGB's add_inverse_edge: ogbn-products and ogbn-proteins "
                        "store each undirected edge once)")
    q.add_argument("--name", dest="dataset_name", default=None, help="the dataset's name [SRC's name]")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")


def memory_bytes(text: str | None, what: str = "--memory") -> int:
    """Bytes meant by ``--memory`` (a size, or a percentage / fraction of this machine's RAM)."""
    from datapath._runtime.sizes import parse_size  # noqa: PLC0415

    return parse_size(text or DEFAULT_MEMORY, psutil.virtual_memory().total, what)


def working_memory(budget: int, what: str = "--memory") -> int:
    """What is left of ``budget`` for the conversion's buffers beside this process's resident memory."""
    from datapath.graph.external_sort import MIN_MEMORY  # noqa: PLC0415

    held = psutil.Process().memory_info().rss
    left = budget - held - _SLACK
    if left < MIN_MEMORY:
        raise ValueError(f"{what} {budget / 2**20:,.0f} MiB leaves nothing for the conversion: this process "
                         f"already holds {held / 2**20:,.0f} MiB; give at least {(held + _SLACK) / 2**20 + 1:,.0f} MiB")
    return left


def hetero_bytes_needed(spec: Any) -> int:
    """Disk bytes a heterogeneous preset ``spec`` (`datapath.graph.hetero_synthetic.HeteroSpec`) is written in:
    its features (float32) exactly; labels and split ids (int64); per relation and reverse relation a CSR of
    int64 ``indptr``, ``indices`` and edge ids (an upper bound: parallel edges are dropped); JSON files."""
    from datapath.graph._files import npy_bytes  # noqa: PLC0415

    feats = sum(npy_bytes((spec.num_nodes[t], w), np.float32) for t, w in spec.features.items())
    n_target = spec.num_nodes[spec.target]
    node_files = npy_bytes((n_target,), np.int64) * 2 + 3 * npy_bytes((0,), np.int64)
    graph = 0
    for (src, name, dst), m in spec.edges.items():
        for d in (dst, src) if name in spec.reverse else (dst,):
            graph += npy_bytes((spec.num_nodes[d] + 1,), np.int64) + 2 * npy_bytes((m,), np.int64) + _JSON_FILE
    return feats + node_files + graph + 4 * _JSON_FILE


_JSON_FILE = 4 << 10  # one small JSON file (graph.json, hetero.json, meta.json)


def check_import_arguments(args: argparse.Namespace) -> None:
    """Reject options that do not fit ``--from KIND`` before any work starts."""
    kind = args.source_kind
    lists = ("csv", "parquet", "npz")
    only = {"--features": (args.features, lists), "--labels": (args.labels, lists),
            "--header": (args.header, ("csv",)), "--columns": (args.columns, ("parquet",)),
            "--num-nodes": (args.num_nodes, lists), "--add-reverse-edges": (args.add_reverse_edges, ("ogb", *lists)),
            "--split": (args.split, ("ogb", *lists)), "--memory": (args.memory, ("ogb", *lists))}
    if kind is None:
        given = [k for k, (v, _) in only.items() if v]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --from KIND only (importing a graph)")
        return
    for flag, (v, kinds) in only.items():
        if v and kind not in kinds:
            raise ValueError(f"{flag} does not apply to --from {kind} (only to {', '.join(kinds)})")
    if args.memory_gb is not None or args.shards is not None or args.device is not None:
        raise ValueError("--memory-gb, --shards and --device apply to the synthetic presets, not to --from")
    if args.num_nodes is not None and args.num_nodes < 0:
        raise ValueError(f"--num-nodes must be >= 0, got {args.num_nodes}")
    memory_bytes(args.memory)


def run_import(args: argparse.Namespace) -> int:
    """``prepare-dataset --from``: convert, then print what was written."""
    check_import_arguments(args)
    t0 = time.perf_counter()
    memory = working_memory(memory_bytes(args.memory))
    cols = [c.strip() for c in args.columns.split(",")] if args.columns else None
    if cols is not None and len(cols) != 2:
        raise ValueError(f"--columns takes two names (source,destination), got {args.columns!r}")
    out = import_dataset(args.source_kind, args.name_or_source, args.directory, memory=memory, split=args.split,
                         features=args.features, labels=args.labels, num_nodes=args.num_nodes, header=args.header,
                         columns=cols, add_reverse_edges=args.add_reverse_edges, name=args.dataset_name, seed=args.seed,
                         overwrite=args.overwrite, progress=not args.no_progress)
    took = time.perf_counter() - t0
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        print(f"wrote {meta['name']} to {out}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, "
              f"{meta['num_features']} features, {meta['num_classes']} classes ({took:.1f} s)")
    else:
        g = json.loads((out / "graph.json").read_text())
        print(f"wrote a graph to {out}: {g['num_dst_nodes']:,} nodes, {g['num_edges']:,} edges ({took:.1f} s); "
              f"no --features/--labels, so Graph.load reads it (not a training dataset)")
    return 0
