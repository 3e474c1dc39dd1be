"""Layers whose graph is gone by the time the backward runs, and many graphs built and dropped in one process.

A layer's backward may run after the graph it was called on was dropped (``layer(block.to("cuda"), x)``): what
the backward launches over (the transposed CSR, its schedule) must be held by the backward, not found at the
address it had.  Here the freed memory is handed out again (zero-filled tensors allocated until they land where
the graph's tensors were: checked) before the backward runs, and every result is compared with the layer run on
the CPU in float64.
"""
from __future__ import annotations

import copy
import ctypes
import gc

import numpy as np

import pytest
import torch
from torch import nn

from datapath.graph import CSRGraph, Graph
from datapath.loaders import NeighborLoader
from datapath.nn import GATConv, GCNConv, GINConv, SAGEConv
from datapath.ops import as_csr
from datapath.ops.tolerance import assert_close, tolerance
from datapath.testing import power_law_csr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def graph_tensors(graph) -> dict[int, int]:  # noqa: ANN001
    """address -> bytes of every tensor the ops keep for ``graph`` (its view, the transposed view, schedules)."""
    return {t.data_ptr(): t.untyped_storage().nbytes() for t in as_csr(graph).tensors() if t.numel()}


def reuse_freed(freed: dict[int, int], device: str, rounds: int = 40) -> tuple[list[torch.Tensor], int]:
    """Allocate zero-filled tensors of the freed tensors' sizes until they land on the freed addresses; returns
    the allocations (keep them alive) and how many freed addresses were taken."""
    hits: set[int] = set()
    keep: list[torch.Tensor] = []
    sizes = sorted(set(freed.values()))
    for _ in range(rounds):
        for n in sizes:
            t = torch.zeros(max(1, n // 8), dtype=torch.int64, device=device)
            keep.append(t)
            if t.data_ptr() in freed:
                hits.add(t.data_ptr())
        if len(hits) == len(freed):
            break
    return keep, len(hits)


def row_len(csr: CSRGraph, width: int) -> int:
    """The most terms behind one output or gradient element of a layer over ``csr`` (see ops.tolerance): a
    parameter's gradient sums over every edge (attention) or source row, through matmuls of ``width``."""
    return csr.indices.numel() + csr.num_src_nodes + 2 * width


def make_layer(kind: str, fin: int, fout: int) -> nn.Module:
    return {
        "sage_mean": lambda: SAGEConv(fin, fout, aggr="mean"),
        "sage_sum": lambda: SAGEConv(fin, fout, aggr="sum"),
        "sage_max": lambda: SAGEConv(fin, fout, aggr="max"),
        "gcn": lambda: GCNConv(fin, fout),
        "gin": lambda: GINConv(nn.Linear(fin, fout), eps=0.3),
        "gat": lambda: GATConv(fin, fout, heads=2),
    }[kind]()


def check_dropped_graph_step(layer: nn.Module, make_graph, cpu_graph, x_cpu: torch.Tensor, device: str,  # noqa: ANN001
                             what: str) -> int:
    """One forward on a graph made by ``make_graph()`` and dropped before the backward (its freed memory reused);
    outputs and every gradient compared with the float64 CPU layer on ``cpu_graph``.  Returns the addresses reused."""
    ref = copy.deepcopy(layer).double().cpu()
    layer = layer.to(device)
    x = x_cpu.clone().to(device).requires_grad_()
    g = make_graph()
    out = layer(g, x)
    freed = graph_tensors(g)
    del g
    gc.collect()
    keep, reused = reuse_freed(freed, device)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device)
    out.backward(gy)
    if device == "cuda":
        torch.cuda.synchronize()
    del keep
    rx = x_cpu.detach().double().requires_grad_()
    want = ref(cpu_graph, rx)
    want.backward(gy.cpu().double())
    depth = 8 if isinstance(layer, GATConv) else 4  # projection, aggregation, root, bias (+ attention scores)
    tol = tolerance(torch.float32, row_len(cpu_graph, max(x_cpu.shape[1], out.shape[1])), depth=depth)
    assert_close(out, want, tol, what + " forward")
    assert_close(x.grad, rx.grad, tol, what + " grad x")
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, tol, f"{what} grad {name}")
    return reused


def issue35_block() -> tuple[object, torch.Tensor]:
    """The block of issue 35: a random graph of 2,562 nodes and 16,578 edges, the first 141 nodes as seeds,
    fanout 10, sampled on the CPU; and 68-wide features of its sources."""
    gen = torch.Generator().manual_seed(35)
    graph = Graph.from_edge_index(torch.randint(0, 2562, (2, 16578), generator=gen), 2562)
    loader = NeighborLoader(graph, torch.arange(141), [10], batch_size=141, device="cpu")
    block = next(iter(loader)).blocks[0]
    assert block.num_dst_nodes == 141 and block.num_src_nodes > 4 * 141
    return block, torch.randn(block.num_src_nodes, 68, generator=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_issue35_sage_mean_projecting_first_backward_after_the_block_is_dropped(device: str) -> None:
    """The reported case: ``SAGEConv(68, 31, aggr="mean")`` on ``block.to(device)``, the block dropped after the
    forward (its addresses handed out again, zero-filled), then the backward: every gradient is right."""
    torch.manual_seed(0)
    block, x = issue35_block()
    reused = check_dropped_graph_step(SAGEConv(68, 31, aggr="mean"), lambda: block.to(device), block, x, device,
                                      "issue 35 SAGEConv(68, 31, mean)")
    if device == "cuda":
        assert reused >= 1, "no freed address of the dropped block was handed out again: the test proved nothing"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sage_mean", "sage_sum", "gcn", "gin"])
def test_one_node_layers_backward_after_a_whole_graph_is_dropped(device: str, kind: str) -> None:
    """GCN, GIN and SAGE (projecting first: one autograd node) on a whole graph made for the call and dropped."""
    torch.manual_seed(1)
    g = power_law_csr(200, 200, 1600, seed=4)
    x = torch.randn(200, 40)
    reused = check_dropped_graph_step(
        make_layer(kind, 40, 9),
        lambda: CSRGraph(g.indptr.to(device), g.indices.to(device), 200, 200), g, x, device, kind)
    if device == "cuda":
        assert reused >= 1


@pytest.mark.gpu
def test_many_graphs_and_blocks_built_and_dropped_reuse_addresses_and_stay_right() -> None:
    """Random shapes (nodes 50-1,500, blocks from NeighborLoader with fanouts 1-11, widths 1-95), every layer,
    forward and backward on CUDA float32 against the CPU float64 layer; each graph dropped before its backward.
    The graphs' addresses are reused across cases (checked): a cache keyed by an address would serve a stale
    entry here."""
    gen = torch.Generator().manual_seed(350)
    kinds = ["sage_mean", "sage_sum", "sage_max", "gcn", "gin", "gat"]
    seen: dict[int, int] = {}
    repeats = 0
    for case in range(30):
        n = int(torch.randint(50, 1500, (1,), generator=gen))
        e = int(torch.randint(1, 12, (1,), generator=gen)) * n
        graph = Graph.from_edge_index(torch.randint(0, n, (2, e), generator=gen), n)
        kind = kinds[case % len(kinds)]
        fin = int(torch.randint(1, 96, (1,), generator=gen))
        fout = int(torch.randint(1, 96, (1,), generator=gen))
        if kind == "gcn" or case % 3 == 0:  # a whole graph
            cpu_graph = CSRGraph(graph.indptr, graph.indices, n, n)
            x = torch.randn(n, fin, generator=gen)
        else:  # a sampled block
            seeds = int(torch.randint(1, min(400, n), (1,), generator=gen))
            fanout = int(torch.randint(1, 12, (1,), generator=gen))
            loader = NeighborLoader(graph, torch.randperm(n, generator=gen)[:seeds], [fanout], batch_size=seeds,
                                    device="cpu")
            cpu_graph = next(iter(loader)).blocks[0]
            x = torch.randn(cpu_graph.num_src_nodes, fin, generator=gen)
        layer = make_layer(kind, fin, fout)

        def on_gpu(src=cpu_graph):  # noqa: ANN001, ANN202
            if isinstance(src, CSRGraph):
                g = CSRGraph(src.indptr.cuda(), src.indices.cuda(), src.num_src_nodes, src.num_dst_nodes)
            else:
                g = src.to("cuda")
            for t in (g.indptr, g.indices):
                seen[t.data_ptr()] = seen.get(t.data_ptr(), 0) + 1
            return g
        check_dropped_graph_step(layer, on_gpu, cpu_graph, x, "cuda", f"case {case} {kind} n={n} {fin}->{fout}")
    repeats = sum(1 for c in seen.values() if c > 1)
    assert repeats > 0, "no address was reused across the graphs: the test proved nothing about address-keyed caches"


def test_gin_one_plus_eps_follows_its_buffer_not_its_address() -> None:
    """GINConv keeps ``1 + eps`` for a fixed eps: a new eps buffer and a ``.data`` swap are seen, not served the old
    value -- also where the new buffer lands at the old one's address (a kept value keyed by the address would be
    served then; keyed by the buffer, the old buffer is held and its address cannot be handed out)."""
    g = power_law_csr(30, 30, 120, seed=9)
    x = torch.randn(30, 6)
    layer = GINConv(nn.Linear(6, 6), eps=0.0)
    layer(g, x)  # keeps 1 + 0
    storage = layer.eps.untyped_storage()
    old = layer.eps.data_ptr()
    # a new buffer at the old one's address with a fresh version counter, as a caching allocator hands out freed
    # memory: made deterministic here by a new tensor over the same bytes (kept alive by `storage`)
    cells = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(old))
    cells[0] = 0.5
    layer.eps = torch.from_numpy(cells)
    assert layer.eps.data_ptr() == old and layer.eps._version == 0 and storage.nbytes() == 4
    want = layer.nn(reference_sum(g, x) + 1.5 * x)
    torch.testing.assert_close(layer(g, x), want)
    layer.eps.data = torch.tensor([-0.25])  # a .data swap: same tensor object, same version counter
    torch.testing.assert_close(layer(g, x), layer.nn(reference_sum(g, x) + 0.75 * x))
    with torch.no_grad():
        layer.eps.fill_(1.0)  # in place: a new version
    torch.testing.assert_close(layer(g, x), layer.nn(reference_sum(g, x) + 2.0 * x))


def reference_sum(g: CSRGraph, x: torch.Tensor) -> torch.Tensor:
    ip = g.indptr
    rows = torch.repeat_interleave(torch.arange(g.num_dst_nodes), ip[1:] - ip[:-1])
    return torch.zeros(g.num_dst_nodes, x.shape[1]).index_add_(0, rows, x[g.indices.long()])
