"""Graphs in: PyG Data, OGB folders (raw CSV and NPZ), CSV / Parquet / NumPy edge lists -> a dataset directory
whose CSR, features and labels equal the source (the CSR compared with `Graph.from_edge_index` of the same edges)."""
from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from datapath.cli import main
from datapath.graph import Dataset, Graph, import_dataset, load_dataset

N, E, F, C = 1009, 5003, 7, 5


def _random_source(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, N - 3, E), rng.integers(0, N - 3, E)  # the last nodes isolated
    src[:40] = dst[:40]  # self loops
    src[40:80], dst[40:80] = src[80:120], dst[80:120]  # duplicate edges
    labels = rng.integers(0, C, N)
    perm = rng.permutation(N)
    return {"edge_index": np.stack([src, dst]), "x": rng.standard_normal((N, F)).astype(np.float32),
            "y": labels, "train": np.sort(perm[:600]), "valid": np.sort(perm[600:800]), "test": np.sort(perm[800:])}


def _write_csv_gz(path, rows, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for r in np.atleast_1d(rows):
            f.write(",".join(fmt % v for v in np.atleast_1d(r)) + "\n")


def _ogb_folder(root, s: dict, layout: str):
    """An OGB node-property folder as OGB writes it (raw CSV, or the binary data.npz / node-label.npz)."""
    raw = root / "raw"
    raw.mkdir(parents=True)
    if layout == "csv":
        _write_csv_gz(raw / "edge.csv.gz", s["edge_index"].T, "%d")
        _write_csv_gz(raw / "num-node-list.csv.gz", np.array([N]), "%d")
        _write_csv_gz(raw / "num-edge-list.csv.gz", np.array([E]), "%d")
        _write_csv_gz(raw / "node-feat.csv.gz", s["x"], "%.9g")
        _write_csv_gz(raw / "node-label.csv.gz", s["y"][:, None], "%d")
    else:
        np.savez_compressed(raw / "data.npz", edge_index=s["edge_index"], node_feat=s["x"],
                            num_nodes_list=np.array([N]), num_edges_list=np.array([E]))
        np.savez_compressed(raw / "node-label.npz", node_label=s["y"][:, None].astype(np.float32))
    for k in ("train", "valid", "test"):
        _write_csv_gz(root / "split" / "time" / f"{k}.csv.gz", s[k], "%d")
    return root


def _assert_equals_source(out, s: dict, edge_index: np.ndarray | None = None) -> None:
    ds = load_dataset(out)
    ref = Graph.from_edge_index(torch.from_numpy(s["edge_index"] if edge_index is None else edge_index),
                                num_nodes=N)
    assert torch.equal(ds.graph.indptr, ref.indptr) and torch.equal(ds.graph.indices, ref.indices)
    assert ds.graph.indices.dtype == ref.indices.dtype
    assert torch.equal(ds.features, torch.from_numpy(s["x"]))
    assert torch.equal(ds.labels, torch.from_numpy(s["y"]).long())
    for k, v in (("train_idx", "train"), ("val_idx", "valid"), ("test_idx", "test")):
        assert torch.equal(getattr(ds, k), torch.from_numpy(s[v]).long())
    assert ds.num_classes == int(s["y"].max()) + 1


def test_pyg_data_in_memory_and_from_a_file(tmp_path) -> None:
    from torch_geometric.data import Data

    s = _random_source(1)
    masks = {}
    for k, v in (("train", "train"), ("val", "valid"), ("test", "test")):
        m = torch.zeros(N, dtype=torch.bool)
        m[torch.from_numpy(s[v])] = True
        masks[f"{k}_mask"] = m
    data = Data(edge_index=torch.from_numpy(s["edge_index"]), x=torch.from_numpy(s["x"]),
                y=torch.from_numpy(s["y"]), num_nodes=N, **masks)
    g = Graph.from_pyg(data)
    ref = Graph.from_edge_index(data.edge_index, num_nodes=N)
    assert torch.equal(g.indptr, ref.indptr) and torch.equal(g.indices, ref.indices)
    ds = Dataset.from_pyg(data)
    assert torch.equal(ds.features, data.x) and torch.equal(ds.labels, data.y) and ds.num_classes == C
    # an OGB-style split dict instead of masks
    ds2 = Dataset.from_pyg(Data(edge_index=data.edge_index, x=data.x, y=data.y[:, None], num_nodes=N),
                           split={k: torch.from_numpy(s[k]) for k in ("train", "valid", "test")})
    assert torch.equal(ds2.val_idx, torch.from_numpy(s["valid"])) and torch.equal(ds2.labels, ds.labels)
    torch.save(data, tmp_path / "data.pt")
    assert main(["prepare-dataset", "--from", "pyg", str(tmp_path / "data.pt"), str(tmp_path / "out"),
                 "--no-progress"]) == 0
    _assert_equals_source(tmp_path / "out", s)


@pytest.mark.parametrize("layout", ["csv", "npz"])
def test_ogb_folder(tmp_path, layout) -> None:
    s = _random_source(2)
    src = _ogb_folder(tmp_path / "ogbn_test", s, layout)
    assert main(["prepare-dataset", "--from", "ogb", str(src), str(tmp_path / "out"), "--no-progress"]) == 0
    _assert_equals_source(tmp_path / "out", s)
    meta = load_dataset(tmp_path / "out").meta
    assert meta["name"] == "ogbn_test" and meta["source"]["layout"] == layout and meta["sort"]["runs"] == 0
    # a budget of a few thousand edges: the edges are sorted on disk in runs and merged
    import_dataset("ogb", src, tmp_path / "small", memory=1 << 16, progress=False)
    _assert_equals_source(tmp_path / "small", s)
    assert load_dataset(tmp_path / "small").meta["sort"]["runs"] > 1
    if layout == "npz":  # the imported dataset trains
        assert main(["train-gnn", "--dataset", str(tmp_path / "out"), "--device", "cpu", "--epochs", "1",
                     "--max-batches", "2", "--batch-size", "64", "--eval-nodes", "50", "--no-progress"]) == 0


def test_ogb_reverse_edges_and_unlabelled_nodes(tmp_path) -> None:
    """OGB's add_inverse_edge (u->v then v->u) and NaN labels of nodes in no split (ogbn-papers100M)."""
    s = _random_source(3)
    src = _ogb_folder(tmp_path / "ogb", s, "npz")
    in_split = np.concatenate([s["train"], s["valid"], s["test"]])
    free = np.setdiff1d(np.arange(N), in_split)
    y = s["y"].astype(np.float32)[:, None]
    assert free.size == 0  # every node is in a split here: take some out of the test split
    s["test"], gone = s["test"][:-5], s["test"][-5:]
    _write_csv_gz(src / "split" / "time" / "test.csv.gz", s["test"], "%d")
    y[gone] = np.nan
    np.savez(src / "raw" / "node-label.npz", node_label=y)
    out = import_dataset("ogb", src, tmp_path / "out", memory=1 << 16, add_reverse_edges=True, progress=False)
    ds = load_dataset(out)
    ei = s["edge_index"]
    both = np.empty((2, 2 * E), np.int64)
    both[:, 0::2], both[0, 1::2], both[1, 1::2] = ei, ei[1], ei[0]
    ref = Graph.from_edge_index(torch.from_numpy(both), num_nodes=N)
    assert torch.equal(ds.graph.indptr, ref.indptr) and torch.equal(ds.graph.indices, ref.indices)
    expect = s["y"].copy()
    expect[gone] = 0
    assert torch.equal(ds.labels, torch.from_numpy(expect)) and ds.meta["unlabelled_nodes"] == 5


def _node_files(tmp_path, s: dict) -> list[str]:
    np.save(tmp_path / "x.npy", s["x"])
    np.savetxt(tmp_path / "y.csv", s["y"], fmt="%d")
    split = tmp_path / "split"
    split.mkdir()
    for k in ("train", "valid", "test"):
        np.save(split / f"{k}.npy", s[k])
    return ["--features", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.csv"), "--split", str(split)]


def test_csv_edge_list_with_header(tmp_path) -> None:
    s = _random_source(4)
    with open(tmp_path / "edges.csv", "w") as f:
        f.write("src,dst\n")
        np.savetxt(f, s["edge_index"].T, fmt="%d", delimiter=",")
    args = ["prepare-dataset", "--from", "csv", str(tmp_path / "edges.csv"), str(tmp_path / "out"), "--header",
            "--no-progress", *_node_files(tmp_path, s)]
    assert main(args) == 0
    _assert_equals_source(tmp_path / "out", s)


def test_parquet_edge_list(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    s = _random_source(5)
    table = pa.table({"weight": np.ones(E), "u": s["edge_index"][0].astype(np.int32), "v": s["edge_index"][1]})
    pq.write_table(table, tmp_path / "edges.parquet", row_group_size=300)
    assert main(["prepare-dataset", "--from", "parquet", str(tmp_path / "edges.parquet"), str(tmp_path / "out"),
                 "--columns", "u,v", "--no-progress", *_node_files(tmp_path, s)]) == 0
    _assert_equals_source(tmp_path / "out", s)


@pytest.mark.parametrize("form", ["npz", "npy_2xE", "npy_Ex2"])
def test_numpy_edge_lists(tmp_path, form) -> None:
    s = _random_source(6)
    if form == "npz":
        masks = {f"{k}_mask": np.isin(np.arange(N), s[v]) for k, v in
                 (("train", "train"), ("val", "valid"), ("test", "test"))}
        np.savez(tmp_path / "g.npz", edge_index=s["edge_index"], x=s["x"], y=s["y"], **masks)
        args = [str(tmp_path / "g.npz"), str(tmp_path / "out")]
    else:
        arr = s["edge_index"] if form == "npy_2xE" else s["edge_index"].T.copy()
        np.save(tmp_path / "e.npy", arr)
        args = [str(tmp_path / "e.npy"), str(tmp_path / "out"), *_node_files(tmp_path, s)]
    assert main(["prepare-dataset", "--from", "npz", *args, "--memory", "4GB", "--no-progress"]) == 0
    _assert_equals_source(tmp_path / "out", s)


def test_edge_list_alone_is_a_graph_directory(tmp_path) -> None:
    s = _random_source(7)
    np.save(tmp_path / "e.npy", s["edge_index"])
    out = import_dataset("npz", tmp_path / "e.npy", tmp_path / "g", memory=1 << 20, num_nodes=N, progress=False)
    g = Graph.load(out)
    ref = Graph.from_edge_index(torch.from_numpy(s["edge_index"]), num_nodes=N)
    assert torch.equal(g.indptr, ref.indptr) and torch.equal(g.indices, ref.indices)


def test_dgl_graph() -> None:
    dgl = pytest.importorskip("dgl")
    s = _random_source(8)
    g = dgl.graph((torch.from_numpy(s["edge_index"][0]), torch.from_numpy(s["edge_index"][1])), num_nodes=N)
    g.ndata["feat"], g.ndata["label"] = torch.from_numpy(s["x"]), torch.from_numpy(s["y"])
    for k, v in (("train", "train"), ("val", "valid"), ("test", "test")):
        m = torch.zeros(N, dtype=torch.bool)
        m[torch.from_numpy(s[v])] = True
        g.ndata[f"{k}_mask"] = m
    ds = Dataset.from_dgl(g)
    ref = Graph.from_edge_index(torch.from_numpy(s["edge_index"]), num_nodes=N)
    assert torch.equal(ds.graph.indptr, ref.indptr) and torch.equal(ds.graph.indices, ref.indices)
    assert torch.equal(ds.features, torch.from_numpy(s["x"])) and torch.equal(ds.test_idx, torch.from_numpy(s["test"]))


def test_random_split_of_the_labelled_nodes(tmp_path) -> None:
    """No split given: 80/10/10 of the labelled nodes by a hash of (node, seed); unlabelled nodes in none."""
    s = _random_source(9)
    y = s["y"].astype(np.float64)
    y[::7] = np.nan
    np.savez(tmp_path / "g.npz", edge_index=s["edge_index"], x=s["x"], y=y)
    a = load_dataset(import_dataset("npz", tmp_path / "g.npz", tmp_path / "a", memory=1 << 16, progress=False))
    b = load_dataset(import_dataset("npz", tmp_path / "g.npz", tmp_path / "b", memory=1 << 20, progress=False))
    c = load_dataset(import_dataset("npz", tmp_path / "g.npz", tmp_path / "c", memory=1 << 20, seed=1,
                                    progress=False))
    parts = [a.train_idx, a.val_idx, a.test_idx]
    labelled = torch.from_numpy(np.flatnonzero(~np.isnan(y)))
    assert torch.equal(torch.sort(torch.cat(parts)).values, labelled)  # disjoint, every labelled node once
    assert abs(len(a.train_idx) / len(labelled) - 0.8) < 0.05 and len(a.val_idx) > 0.05 * len(labelled)
    assert torch.equal(a.train_idx, b.train_idx) and not torch.equal(a.train_idx, c.train_idx)
    assert a.meta["unlabelled_nodes"] == len(y[::7]) and a.meta["split"].startswith("random")
