"""Graph construction, validation, files and placement."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from datapath.graph import Graph, InvalidGraphError


def _random_edges(n: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (2, e), generator=g)


def _reference_in_neighbours(edge_index: torch.Tensor, n: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(n)]
    for s, d in edge_index.t().tolist():
        rows[d].append(s)
    return rows


def test_from_edge_index_groups_by_destination() -> None:
    n = 300
    ei = _random_edges(n, 4000, 1)
    g = Graph.from_edge_index(ei, n, keep_edge_ids=True)
    ref = _reference_in_neighbours(ei, n)
    for v in range(n):
        row = g.indices[g.indptr[v]:g.indptr[v + 1]].tolist()
        assert row == ref[v]  # stable: parallel edges keep their order
    # edge ids point back to the columns of edge_index
    assert torch.equal(ei[0][g.edge_ids], g.indices.long())
    back = g.edge_index()
    assert torch.equal(back[1], ei[1][g.edge_ids])


def test_from_scipy_matches_from_edge_index() -> None:
    n = 200
    ei = torch.unique(_random_edges(n, 3000, 2), dim=1)
    a = sp.coo_matrix((np.random.default_rng(0).random(ei.shape[1]) + 0.5, (ei[1].numpy(), ei[0].numpy())),
                      shape=(n, n))
    g1 = Graph.from_scipy(a)
    g2 = Graph.from_edge_index(ei, n)
    assert torch.equal(g1.indptr, g2.indptr)
    for v in range(n):
        assert sorted(g1.indices[g1.indptr[v]:g1.indptr[v + 1]].tolist()) == \
            sorted(g2.indices[g2.indptr[v]:g2.indptr[v + 1]].tolist())


def test_from_scipy_bipartite() -> None:
    a = sp.random(50, 80, density=0.1, format="csr", random_state=3)
    g = Graph.from_scipy(a)
    assert g.num_dst_nodes == 50 and g.num_src_nodes == 80 and g.num_edges == a.nnz


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_save_load_memory_mapped(tmp_path, idx_dtype) -> None:
    n = 500
    g = Graph.from_edge_index(_random_edges(n, 5000, 3), n)
    g = Graph(g.indptr, g.indices.to(idx_dtype), edge_ids=torch.randperm(g.num_edges))
    g.save(tmp_path)
    h = Graph.load(tmp_path)
    assert torch.equal(h.indptr, g.indptr) and torch.equal(h.indices, g.indices)
    assert torch.equal(h.edge_ids, g.edge_ids) and h.indices.dtype == idx_dtype
    # memory-mapped copy-on-write: writing the tensor never touches the file
    h.indices[0] = h.indices[0] + 1
    assert torch.equal(Graph.load(tmp_path).indices, g.indices)
    assert Graph.load(tmp_path, mmap=False).num_edges == g.num_edges


def _valid_csr() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0, 2, 3, 5]), torch.tensor([1, 2, 0, 0, 1], dtype=torch.int32)


@pytest.mark.parametrize("case, match", [
    ("non_monotone", "non-decreasing"),
    ("out_of_range", "indices range"),
    ("negative", "indices range"),
    ("bad_end", "end at len"),
    ("bad_start", "start at 0"),
    ("float_dtype", "int32 or int64"),
    ("uint8_numpy", "int32 or int64"),
    ("two_dim", "1-D"),
    ("edge_ids_length", "edge_ids has"),
    ("empty_indptr", "num_nodes\\+1"),
])
def test_malformed_graphs_raise(case: str, match: str) -> None:
    indptr, indices = _valid_csr()
    kw = {}
    if case == "non_monotone":
        indptr = torch.tensor([0, 3, 2, 5])
    elif case == "out_of_range":
        indices = torch.tensor([1, 2, 0, 3, 1], dtype=torch.int32)
    elif case == "negative":
        indices = torch.tensor([1, -1, 0, 0, 1], dtype=torch.int32)
    elif case == "bad_end":
        indptr = torch.tensor([0, 2, 3, 4])
    elif case == "bad_start":
        indptr = torch.tensor([1, 2, 3, 5])
    elif case == "float_dtype":
        indices = indices.float()
    elif case == "uint8_numpy":
        indices = indices.numpy().astype(np.uint8)
    elif case == "two_dim":
        indices = indices.view(1, -1)
    elif case == "edge_ids_length":
        kw["edge_ids"] = torch.arange(4)
    elif case == "empty_indptr":
        indptr = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(InvalidGraphError, match=match):
        Graph(indptr, indices, **kw)
    assert issubclass(InvalidGraphError, ValueError)


def test_bipartite_source_count_checked() -> None:
    indptr, indices = _valid_csr()
    Graph(indptr, indices, num_src_nodes=3)
    with pytest.raises(InvalidGraphError, match="indices range"):
        Graph(indptr, indices, num_src_nodes=2)


def test_edge_index_validation() -> None:
    with pytest.raises(InvalidGraphError, match="shape"):
        Graph.from_edge_index(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(InvalidGraphError, match="num_nodes"):
        Graph.from_edge_index(torch.tensor([[0, 5], [1, 2]]), num_nodes=4)


def test_unified_placement() -> None:
    g = Graph.from_edge_index(_random_edges(100, 800, 4), 100)
    u = g.to("unified")
    assert u.placement == ("unified" if torch.cuda.is_available() else "cpu")
    assert torch.equal(u.in_degrees(), g.in_degrees()) and torch.equal(u.indices, g.indices)
    back = u.to("cpu")
    assert back.placement == "cpu" and torch.equal(back.indices, g.indices)
    with pytest.raises(InvalidGraphError, match="can live in"):
        g.to("disk")


@pytest.mark.gpu
def test_cuda_placement_and_validation(cuda_device) -> None:
    g = Graph.from_edge_index(_random_edges(100, 800, 5), 100)
    c = g.to("cuda")
    assert c.placement == "cuda" and torch.equal(c.indices.cpu(), g.indices)
    with pytest.raises(InvalidGraphError, match="indices range"):
        Graph(c.indptr, torch.full_like(c.indices, 100))
    u = g.to("unified")
    assert u.placement == "unified" and u.indices.is_pinned() and u.indices.data_ptr() != g.indices.data_ptr()
    assert torch.equal(u.to("cuda").indptr.cpu(), g.indptr)
