"""The external sort equals numpy's in-memory stable argsort CSR at any budget; malformed inputs to
`import_dataset` / ``prepare-dataset --from`` fail with one error naming the file and the line or column."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from datapath.cli import main
from datapath.graph import DatasetError, InvalidGraphError, edges_to_csr, import_dataset


def _reference_csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src[order]


@pytest.mark.parametrize("seed", range(4))
def test_external_sort_equals_in_memory_argsort(tmp_path, seed) -> None:
    """Duplicate edges, self loops, isolated nodes, hubs and uneven chunks; a budget of ~1600 edges (many runs)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    e = int(rng.integers(20_000, 60_000))
    src = rng.integers(0, n - 7, e)
    dst = (rng.zipf(1.6, e) - 1) % (n - 7) if seed % 2 else rng.integers(0, n - 7, e)  # hubs: rows over a block
    k = e // 10
    src[:k] = dst[:k]                      # self loops
    src[k:2 * k], dst[k:2 * k] = src[2 * k:3 * k], dst[2 * k:3 * k]  # duplicates
    cuts = np.sort(rng.integers(0, e, 40))
    chunks = [(src[a:b], dst[a:b]) for a, b in zip([0, *cuts], [*cuts, e])]
    out = edges_to_csr(chunks, tmp_path / "csr", memory=1 << 16, num_nodes=n)
    assert out.runs > 5 and (out.num_nodes, out.num_edges) == (n, e)
    indptr, indices = _reference_csr(src, dst, n)
    got_ptr, got_idx = np.load(tmp_path / "csr" / "indptr.npy"), np.load(tmp_path / "csr" / "indices.npy")
    assert got_idx.dtype == np.int32 and np.array_equal(got_ptr, indptr) and np.array_equal(got_idx, indices)
    assert not any(p.name.startswith(".edge-runs") for p in (tmp_path / "csr").iterdir())  # runs removed


def test_external_sort_in_one_buffer_and_empty(tmp_path) -> None:
    rng = np.random.default_rng(9)
    src, dst = rng.integers(0, 100, 500), rng.integers(0, 100, 500)
    out = edges_to_csr([(src, dst)], tmp_path / "a", memory=1 << 24, num_nodes=120)
    assert out.runs == 0
    indptr, indices = _reference_csr(src, dst, 120)
    assert np.array_equal(np.load(tmp_path / "a" / "indptr.npy"), indptr)
    assert np.array_equal(np.load(tmp_path / "a" / "indices.npy"), indices)
    out = edges_to_csr([], tmp_path / "b", memory=1 << 20, num_nodes=3)
    assert np.array_equal(np.load(tmp_path / "b" / "indptr.npy"), np.zeros(4, np.int64)) and out.num_edges == 0


def test_external_sort_rejects_bad_ids_and_budgets(tmp_path) -> None:
    with pytest.raises(InvalidGraphError, match=r"\[-1, 4\]"):
        edges_to_csr([(np.array([0, -1]), np.array([4, 2]))], tmp_path / "x", memory=1 << 20)
    with pytest.raises(InvalidGraphError, match="num_nodes|must lie in"):
        edges_to_csr([(np.array([0, 5]), np.array([1, 2]))], tmp_path / "y", memory=1 << 20, num_nodes=5)
    with pytest.raises(ValueError, match="too small"):
        edges_to_csr([], tmp_path / "z", memory=1000)


# -- malformed inputs ------------------------------------------------------------------------------
def _csv(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, where", [
    ("0,1\n2,x\n", r"edges\.csv, line 2, column 2: 'x' is not an integer"),
    ("0,1\n2,3.5\n", r"line 2, column 2: '3\.5' is not an integer"),
    ("0,1\n\n# comment\n2,-3\n", r"edges\.csv, line 4, column 2: -3 is a negative node id"),
    ("0,1\n1,2,3\n", r"edges\.csv, line 2: 3 columns; expected 2"),
    ("0 1 2\n", r"edges\.csv, line 1: 3 columns; expected 2"),
])
def test_malformed_csv_edges_name_file_line_and_column(tmp_path, text, where) -> None:
    p = _csv(tmp_path / "edges.csv", text)
    with pytest.raises(DatasetError, match=where):
        import_dataset("csv", p, tmp_path / "out", memory=1 << 20, progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_malformed_line_deep_in_a_gzip_file_is_located(tmp_path) -> None:
    p = tmp_path / "edges.csv.gz"
    with gzip.open(p, "wt") as f:
        for i in range(50_000):
            f.write(f"{i % 97},{(i * 7) % 101}\n" if i != 43_210 else "5;6\n")
    with pytest.raises(DatasetError, match=r"edges\.csv\.gz, line 43211: 1 columns; expected 2"):
        import_dataset("csv", p, tmp_path / "out", memory=1 << 16, progress=False)


def test_id_out_of_range_and_mismatched_rows(tmp_path) -> None:
    p = _csv(tmp_path / "edges.csv", "0,1\n1,2\n2,9\n")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.array([0, 1, 0, 1, 1]))
    with pytest.raises(DatasetError, match=r"edges\.csv, line 3, column 2: node id 9 is out of range: there are 5 "):
        import_dataset("csv", p, tmp_path / "out", memory=1 << 20, features=tmp_path / "x.npy",
                       labels=tmp_path / "y.npy", progress=False)
    np.save(tmp_path / "y4.npy", np.array([0, 1, 0, 1]))
    p2 = _csv(tmp_path / "ok.csv", "0,1\n1,2\n2,4\n")
    with pytest.raises(DatasetError, match=r"y4\.npy has 4 rows but the graph has 5 nodes"):
        import_dataset("csv", p2, tmp_path / "out", memory=1 << 20, features=tmp_path / "x.npy",
                       labels=tmp_path / "y4.npy", progress=False)
    np.savetxt(tmp_path / "x6.csv", np.ones((6, 3)), delimiter=",")
    with pytest.raises(DatasetError, match=r"x6\.csv, line 6: more feature rows than the graph's 5 nodes"):
        import_dataset("csv", p2, tmp_path / "out", memory=1 << 20, features=tmp_path / "x6.csv",
                       labels=tmp_path / "y.npy", num_nodes=5, progress=False)
    assert not (tmp_path / "out").exists()


def test_float_and_negative_ids_in_arrays(tmp_path) -> None:
    np.save(tmp_path / "f.npy", np.array([[0.0, 1.0], [2.0, 0.5], [1.0, 1.0]]))  # (E, 2)
    with pytest.raises(DatasetError, match=r"f\.npy, row 1, column 2: 0\.5 is not an integer node id"):
        import_dataset("npz", tmp_path / "f.npy", tmp_path / "out", memory=1 << 20, progress=False)
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 1, 2], [1, -2, 0]]))
    with pytest.raises(DatasetError, match=r"g\.npz:edge_index, edge 1 \(edge_index\[:, 1\]\), column 2: -2 is a neg"):
        import_dataset("npz", tmp_path / "g.npz", tmp_path / "out", memory=1 << 20, progress=False)


def test_missing_files_and_folders(tmp_path) -> None:
    with pytest.raises(DatasetError, match=r"nowhere\.csv is missing"):
        import_dataset("csv", tmp_path / "nowhere.csv", tmp_path / "out", memory=1 << 20, progress=False)
    (tmp_path / "ogb" / "raw").mkdir(parents=True)
    with pytest.raises(DatasetError, match="neither edge.csv.gz .* nor data.npz"):
        import_dataset("ogb", tmp_path / "ogb", tmp_path / "out", memory=1 << 20, progress=False)
    with gzip.open(tmp_path / "ogb" / "raw" / "edge.csv.gz", "wt") as f:
        f.write("0,1\n")
    with pytest.raises(DatasetError, match=r"num-node-list\.csv\.gz is missing"):
        import_dataset("ogb", tmp_path / "ogb", tmp_path / "out", memory=1 << 20, progress=False)
    np.savez(tmp_path / "e.npz", edges=np.zeros((2, 2), np.int64))
    with pytest.raises(DatasetError, match="has no edge_index"):
        import_dataset("npz", tmp_path / "e.npz", tmp_path / "out", memory=1 << 20, progress=False)


def test_split_node_without_a_label(tmp_path) -> None:
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 1, 2], [1, 2, 0]]), x=np.ones((3, 2), np.float32),
             y=np.array([0.0, np.nan, 1.0]), train_idx=np.array([0, 1]), val_idx=np.array([2]),
             test_idx=np.array([2]))
    with pytest.raises(DatasetError, match=r"g\.npz:y, row 1, column 1: node 1 is in a split but has no label"):
        import_dataset("npz", tmp_path / "g.npz", tmp_path / "out", memory=1 << 20, progress=False)


def test_cli_errors_are_one_line(tmp_path, capsys) -> None:
    _csv(tmp_path / "edges.csv", "src,dst\n0,1\n")
    assert main(["prepare-dataset", "--from", "csv", str(tmp_path / "edges.csv"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "edges.csv, line 1, column 1: 'src' is not an integer" in err
    assert main(["prepare-dataset", "tiny", str(tmp_path / "o"), "--header"]) == 2
    assert "--header apply to --from KIND only" in capsys.readouterr().err
    assert main(["prepare-dataset", "--from", "ogb", str(tmp_path), str(tmp_path / "o"), "--header"]) == 2
    assert "--header does not apply to --from ogb" in capsys.readouterr().err
    assert main(["prepare-dataset", "--from", "csv", str(tmp_path / "edges.csv"), str(tmp_path / "o"),
                 "--memory", "10MB"]) == 2
    assert "already holds" in capsys.readouterr().err


def test_help_lists_the_import_options(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["prepare-dataset", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--from KIND" in text and "[25%]" in text and "--add-reverse-edges" in text


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without pyarrow sees
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "e.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r'pip install "datapath\[io\]"'):
        import_dataset("parquet", tmp_path / "e.parquet", tmp_path / "out", memory=1 << 20, progress=False)
