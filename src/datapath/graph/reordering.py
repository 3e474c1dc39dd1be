"""Node renumbering for locality (GNNAdvisor §5): neighbours that share ids share cache lines and tiles.

    new_graph, perm = reorder(graph, "rcm")     # perm[new_id] = old_id
    x_new = x[perm]                             # features follow the nodes

Methods (all torch ops on the graph's device, no scipy):

``"rcm"``
    reverse Cuthill-McKee: a breadth-first order from a minimum-degree node of each connected
    component, each level sorted by (parent's position, degree), reversed.  Bandwidth-reducing:
    a row's neighbours get nearby ids.
``"degree"``
    by decreasing degree (hubs first, so the most-read rows share the first cache lines).
``"community"``
    label-propagation communities (a few rounds), nodes grouped by community (largest first) and
    ordered by decreasing degree inside one.  A cheap stand-in for Rabbit order's community
    detection (GNNAdvisor's choice), which merges communities hierarchically.

The graph must be square (``num_src_nodes == num_dst_nodes``); the order treats it as undirected
(the samplers' graphs store both directions).  `window_locality` measures what a method gives the
tensor-core kernel: how many edges of a 16-row window share a source row.
"""
from __future__ import annotations

from typing import Any

import torch

from datapath.graph.csr import CSRGraph

METHODS = ("rcm", "degree", "community")


def _csr(graph: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    indptr, indices = graph.indptr, graph.indices
    n = int(graph.num_dst_nodes)
    if int(graph.num_src_nodes) != n:
        raise ValueError(f"reorder needs a square graph, got {graph.num_src_nodes} sources and {n} destinations")
    if indptr.device != indices.device:
        raise ValueError("graph.indptr and graph.indices must be on one device")
    return indptr.long(), indices.long(), n


def _rows(indptr: torch.Tensor, e: int) -> torch.Tensor:
    n = indptr.numel() - 1
    return torch.repeat_interleave(torch.arange(n, device=indptr.device), indptr[1:] - indptr[:-1], output_size=e)


def _components(rows: torch.Tensor, cols: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64 component label (the smallest node id of the component), by min-label propagation."""
    label = torch.arange(n, device=rows.device)
    while True:
        nxt = label.clone()
        nxt.scatter_reduce_(0, rows, label.index_select(0, cols), "amin")
        nxt.scatter_reduce_(0, cols, label.index_select(0, rows), "amin")
        nxt = nxt.index_select(0, nxt)  # pointer jumping
        if torch.equal(nxt, label):
            return label
        label = nxt


def _rcm(indptr: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    dev = indptr.device
    e = indices.numel()
    rows = _rows(indptr, e)
    deg = (indptr[1:] - indptr[:-1])
    comp = _components(rows, indices, n)
    # one start per component: its minimum-degree node (ties: smallest id)
    key = deg * n + torch.arange(n, device=dev)
    best = torch.full((n,), torch.iinfo(torch.int64).max, device=dev).scatter_reduce_(0, comp, key, "amin")
    starts = torch.unique(best.index_select(0, comp)) % n
    pos = torch.full((n,), -1, dtype=torch.int64, device=dev)  # global BFS position
    level = torch.full((n,), -1, dtype=torch.int64, device=dev)
    # the starts in order of their component's smallest id
    frontier = starts[torch.argsort(comp.index_select(0, starts))]
    pos[frontier] = torch.arange(frontier.numel(), device=dev)
    level[frontier] = 0
    placed, lv = frontier.numel(), 0
    while frontier.numel():
        lv += 1
        fdeg = deg.index_select(0, frontier)
        par = torch.repeat_interleave(frontier, fdeg)
        offs = torch.arange(par.numel(), device=dev) - torch.repeat_interleave(torch.cumsum(fdeg, 0) - fdeg, fdeg)
        nb = indices.index_select(0, indptr.index_select(0, par) + offs)
        fresh = level.index_select(0, nb) < 0
        par, nb = par[fresh], nb[fresh]
        if nb.numel() == 0:
            break
        # each new node follows its earliest parent; ties by degree, then id
        k = (pos.index_select(0, par) * (deg.max() + 1) + deg.index_select(0, nb)) * n + nb
        first = torch.full((n,), torch.iinfo(torch.int64).max, device=dev).scatter_reduce_(0, nb, k, "amin")
        new = torch.unique(nb)
        new = new[torch.argsort(first.index_select(0, new))]
        pos[new] = placed + torch.arange(new.numel(), device=dev)
        level[new] = lv
        placed += new.numel()
        frontier = new
    order = torch.argsort(pos)  # every node is reached from its component's start
    return order.flip(0)


def _label_propagation(indptr: torch.Tensor, indices: torch.Tensor, n: int, rounds: int = 6,
                       seed: int = 0) -> torch.Tensor:
    """(n,) int64 community labels: each node repeatedly takes its neighbours' most frequent label."""
    dev = indptr.device
    e = indices.numel()
    rows = _rows(indptr, e)
    label = torch.arange(n, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    for _ in range(rounds):
        key = rows * n + label.index_select(0, indices)
        uniq, counts = torch.unique(key, return_counts=True)
        node, lab = uniq // n, uniq % n
        best = torch.zeros(n, dtype=torch.int64, device=dev).scatter_reduce_(0, node, counts, "amax")
        cand = torch.where(counts == best.index_select(0, node), lab, torch.iinfo(torch.int64).max)
        choice = torch.full((n,), torch.iinfo(torch.int64).max, device=dev).scatter_reduce_(0, node, cand, "amin")
        has = choice != torch.iinfo(torch.int64).max
        move = has & (torch.rand(n, generator=g, device=dev) < 0.5)  # half the nodes a round: no oscillation
        label = torch.where(move, choice, label)
    return label


def _community(indptr: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    dev = indptr.device
    label = _label_propagation(indptr, indices, n)
    size = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, label, torch.ones_like(label))
    deg = indptr[1:] - indptr[:-1]
    # community size (desc), community id, degree (desc), node id
    k1 = torch.argsort(-deg, stable=True)
    k2 = k1[torch.argsort(label.index_select(0, k1), stable=True)]
    return k2[torch.argsort(-size.index_select(0, label.index_select(0, k2)), stable=True)]


def permute(graph: Any, perm: torch.Tensor) -> Any:
    """``graph`` renumbered so that new node ``i`` is old node ``perm[i]``; rows list neighbours in ascending id."""
    indptr, indices, n = _csr(graph)
    dev = indptr.device
    perm = perm.to(dev).long()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=dev)
    deg = (indptr[1:] - indptr[:-1]).index_select(0, perm)
    new_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(deg, 0, out=new_ptr[1:])
    e = indices.numel()
    new_rows = _rows(new_ptr, e)
    offs = torch.arange(e, device=dev) - new_ptr.index_select(0, new_rows)
    old_pos = indptr.index_select(0, perm.index_select(0, new_rows)) + offs
    cols = inv.index_select(0, indices.index_select(0, old_pos))
    order = torch.argsort(new_rows * n + cols)
    new_idx = cols.index_select(0, order).to(graph.indices.dtype)
    new_ptr = new_ptr.to(graph.indptr.dtype)
    with_csr = getattr(graph, "with_csr", None)
    if with_csr is not None:  # a graph that rebuilds its own kind (`datapath.graph.Graph`)
        return with_csr(new_ptr, new_idx)
    return CSRGraph(new_ptr, new_idx, n, n, trusted=bool(getattr(graph, "trusted", False)))


def reorder(graph: Any, method: str = "rcm") -> tuple[Any, torch.Tensor]:
    """Renumber ``graph``'s nodes by ``method`` (see the module docstring).

    Returns ``(new_graph, perm)``: ``perm`` (N,) int64 on the graph's device with
    ``perm[new_id] = old_id``, so features follow as ``x[perm]`` and results map back as
    ``out_new[inv]`` with ``inv[perm] = arange(N)``.  The new graph is of the input's kind where it
    has a ``with_csr`` method (a `datapath.graph.Graph` does), else a `datapath.graph.CSRGraph`, on
    the same device.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    indptr, indices, n = _csr(graph)
    if n == 0:
        return graph, torch.empty(0, dtype=torch.int64, device=indptr.device)
    if method == "degree":
        perm = torch.argsort(-(indptr[1:] - indptr[:-1]), stable=True)
    elif method == "rcm":
        perm = _rcm(indptr, indices, n)
    else:
        perm = _community(indptr, indices, n)
    return permute(graph, perm), perm


def window_locality(graph: Any, window: int = 16) -> dict[str, float]:
    """How much rows of a ``window``-row window share source rows (what reordering is for).

    Returns ``{"unique_per_window": distinct sources per window, "reuse": edges per distinct
    (window, source) pair}``: the tensor-core kernel loads one row per pair, so higher reuse
    means denser tiles and fewer bytes.
    """
    indptr, indices, n = graph.indptr.long(), graph.indices.long(), int(graph.num_dst_nodes)
    e = indices.numel()
    if e == 0:
        return {"unique_per_window": 0.0, "reuse": 0.0}
    rows = _rows(indptr, e)
    pairs = torch.unique((rows // window) * int(graph.num_src_nodes) + indices).numel()
    return {"unique_per_window": pairs / max(1, -(-n // window)), "reuse": e / pairs}
