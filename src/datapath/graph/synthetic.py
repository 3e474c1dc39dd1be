"""Synthetic power-law graphs with learnable labels, and presets shaped like the seed datasets.

The generator is a degree-corrected planted-partition model (a stochastic block
model whose node weights follow a power law):

- each node gets a community (its label) and a weight ``w ~ Pareto(alpha)``, so
  degrees follow a power law like real web and citation graphs;
- an edge picks its first end with probability proportional to ``w``; the other end
  comes, with probability ``homophily``, from the same community (again in
  proportion to ``w``), otherwise from the whole graph; edges are made undirected,
  deduplicated, without self loops;
- features are ``signal * centroid[label] + noise`` (Gaussian), so one node's own
  features predict its label only weakly, and averaging over its (mostly
  same-community) neighbours helps: accuracy measures whether message passing works.

Everything is drawn from `torch.Generator`s seeded by ``(seed, chunk)``: the same
spec, seed and device type give the same dataset on any machine, however many
threads generate it (the chunk sizes are part of the recipe).  On a GPU machine
generation runs on the GPU (fast for products-size graphs); the result lives in
host memory.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from datapath._runtime.interrupts import check, run_chunks
from datapath.graph.datasets import Dataset
from datapath.graph.errors import DatasetError
from datapath.graph.graph import Graph

log = logging.getLogger("datapath.graph.synthetic")


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and statistics of a synthetic dataset.

    ``num_edges`` counts undirected edges before deduplication; the CSR holds both
    directions (about twice as many entries).
    """

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    homophily: float = 0.7
    alpha: float = 2.3
    signal: float = 0.35
    train_frac: float = 0.5
    val_frac: float = 0.1
    test_frac: float = 0.2
    seed: int = 0


PRESETS: dict[str, SyntheticSpec] = {
    # the quick-start default: generated in a few seconds on a laptop CPU
    "tiny": SyntheticSpec("tiny", 20_000, 200_000, 64, 8, homophily=0.7, signal=0.12,
                          train_frac=0.5, val_frac=0.25, test_frac=0.25),
    # shaped like Reddit (DGL): 233K nodes, 114.6M directed edges, 602 features, 41 classes
    "reddit": SyntheticSpec("reddit", 232_965, 57_307_946, 602, 41, homophily=0.7, signal=0.045,
                            train_frac=0.66, val_frac=0.10, test_frac=0.24),
    # shaped like ogbn-products: 2.45M nodes, 61.9M undirected edges, 100 features, 47 classes
    "products": SyntheticSpec("products", 2_449_029, 61_859_140, 100, 47, homophily=0.7, signal=0.1,
                              train_frac=0.08, val_frac=0.02, test_frac=0.90),
}
PAPERS_FEATURES = 128
PAPERS_AVG_DEGREE = 14.5  # undirected edges per node of ogbn-papers100M (1.6B / 111M)


def papers_spec(memory_gb: float, seed: int = 0) -> SyntheticSpec:
    """A papers100M-shaped spec (128 features, 172 classes) scaled so features + graph take ``memory_gb``.

    Per node: 512 bytes of float32 features, about 2 * 14.5 * 4 bytes of int32 CSR
    indices, 8 bytes of indptr and 8 of label; capped at papers100M's 111M nodes.
    """
    per_node = PAPERS_FEATURES * 4 + 2 * PAPERS_AVG_DEGREE * 4 + 16
    n = int(min(111_059_956, memory_gb * 2**30 / per_node))
    if n < 1000:
        raise DatasetError(f"memory_gb={memory_gb} is too small for a papers-shaped graph")
    return SyntheticSpec("papers", n, int(n * PAPERS_AVG_DEGREE), PAPERS_FEATURES, 172, homophily=0.7,
                         signal=0.09, train_frac=0.011, val_frac=0.001, test_frac=0.002, seed=seed)


def preset_spec(name: str, *, memory_gb: float | None = None, seed: int = 0) -> SyntheticSpec:
    """The spec of preset ``name`` (``tiny``, ``reddit``, ``products``, ``papers``)."""
    if name == "papers":
        if memory_gb is None:
            import psutil  # noqa: PLC0415

            memory_gb = psutil.virtual_memory().total / 2**30 / 4
        return papers_spec(memory_gb, seed)
    if name not in PRESETS:
        raise DatasetError(f"unknown dataset preset {name!r}; choose one of {sorted([*PRESETS, 'papers'])} "
                           f"or give a dataset directory")
    return dataclasses.replace(PRESETS[name], seed=seed)


def _gen(seed: int, stream: int, chunk: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + stream * 65_537 + chunk) % (2**63))
    return g


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, unit="chunk", disable=not enabled, leave=False)


class _Communities:
    """Node weights and communities, with cumulative weights for sampling ends of edges."""

    def __init__(self, spec: SyntheticSpec, device: torch.device) -> None:
        n, c = spec.num_nodes, spec.num_classes
        g = _gen(spec.seed, 0, 0, device)
        self.labels = torch.randint(0, c, (n,), generator=g, device=device)
        u = torch.rand(n, generator=g, device=device, dtype=torch.float64)
        w = (1.0 - u).pow(-1.0 / (spec.alpha - 1.0))
        self.weight = w.clamp(max=float(w.median()) * math.sqrt(n))  # cap the largest hubs
        self.cum = torch.cumsum(self.weight, 0)
        self.total = float(self.cum[-1])
        order = torch.sort(self.labels, stable=True).indices
        self.order = order
        self.cum_sorted = torch.cumsum(self.weight[order], 0)
        counts = torch.bincount(self.labels, minlength=c)
        ends = torch.cumsum(counts, 0)
        starts = ends - counts
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        cs = torch.cat([zero, self.cum_sorted])
        self.comm_lo = cs[starts]
        self.comm_hi = cs[ends]

    def edges(self, m: int, homophily: float, g: torch.Generator, stop: threading.Event | None = None) -> torch.Tensor:
        """(2, m) int64 random edge ends (undirected, self loops possible).

        The random draws are made for all ``m`` edges first (they are the recipe); the ends are then computed
        in pieces, between which a set ``stop`` ends the work (`Stopped`)."""
        dev = self.cum.device
        n = self.cum.numel()
        u = _draw(m, torch.float64, g, stop).mul_(self.total)
        same = _draw(m, torch.float32, g, stop) < homophily
        v = _draw(m, torch.float64, g, stop)
        out = torch.empty((2, m), dtype=torch.int64, device=dev)
        for s in range(0, m, _PIECE):
            check(stop)
            e = min(m, s + _PIECE)
            a = torch.searchsorted(self.cum, u[s:e]).clamp_(max=n - 1)
            comm = self.labels[a]
            lo, hi = self.comm_lo[comm], self.comm_hi[comm]
            vs = v[s:e]
            b_same = self.order[torch.searchsorted(self.cum_sorted, lo + vs * (hi - lo)).clamp_(max=n - 1)]
            b_any = torch.searchsorted(self.cum, vs * self.total).clamp_(max=n - 1)
            out[0, s:e] = a
            out[1, s:e] = torch.where(same[s:e], b_same, b_any)
        return out


_PIECE = 1 << 20       # values computed between two looks at a stop request (a Ctrl-C lands within one piece)
_CPU_SORT = 1 << 22    # edge keys deduplicated by one CPU sort (one uninterruptible call each)


def _draw(m: int, dtype: torch.dtype, g: torch.Generator, stop: threading.Event | None) -> torch.Tensor:
    """``torch.rand(m, generator=g, dtype=dtype)``, on the CPU drawn in pieces (the same numbers), `check`ing
    ``stop`` between them (a GPU draws it at once: there the pieces would give other numbers)."""
    if g.device.type != "cpu":
        return torch.rand(m, generator=g, device=g.device, dtype=dtype)
    out = torch.empty(m, dtype=dtype, device=g.device)
    for s in range(0, m, _PIECE):
        check(stop)
        e = min(m, s + _PIECE)
        out[s:e] = torch.rand(e - s, generator=g, device=g.device, dtype=dtype)
    return out


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def generate(spec: SyntheticSpec | str, *, device: str | torch.device | None = None, progress: bool = True,
             features_out: np.ndarray | torch.Tensor | Callable[[Graph], Any] | None = None, chunk_edges: int = 1 << 24,
             chunk_rows: int = 1 << 18, sort_limit: int = 1 << 30) -> Dataset:
    """Generate the synthetic dataset ``spec`` (a `SyntheticSpec` or preset name) in host memory.

    Args:
        device: where to compute (default: the GPU when there is one). The result is the
            same for the same spec, seed and device type.
        progress: show tqdm bars.
        features_out: optional (N, F) float32 host array to write the features into
            (a ``np.lib.format.open_memmap`` for datasets larger than RAM, or pinned memory), or a
            callable given the built `Graph` that returns one (to size the files before writing).
        chunk_edges: edges generated per parallel chunk.
        chunk_rows: feature rows generated per parallel chunk.
        sort_limit: most edge keys deduplicated by one sort (CUB sorts at most 2^31 items);
            larger graphs are deduplicated in destination ranges (same result).
    """
    if isinstance(spec, str):
        spec = preset_spec(spec)
    dev = torch.device(device) if device is not None else _default_device()
    t0 = time.perf_counter()
    comm = _Communities(spec, dev)
    n = spec.num_nodes
    # edges, in parallel chunks
    n_chunks = max(1, -(-spec.num_edges // chunk_edges))
    sizes = [min(chunk_edges, spec.num_edges - i * chunk_edges) for i in range(n_chunks)]
    keys_parts: list[torch.Tensor] = [torch.empty(0)] * n_chunks

    def edge_chunk(i: int, stop: threading.Event | None = None) -> None:
        e = comm.edges(sizes[i], spec.homophily, _gen(spec.seed, 1, i, dev), stop)
        check(stop)
        e = e[:, e[0] != e[1]]
        keys_parts[i] = torch.cat([e[1] * n + e[0], e[0] * n + e[1]])  # both directions, key = dst*n + src

    _run_chunks(edge_chunk, n_chunks, dev, f"{spec.name}: edges", progress)
    indptr, indices = _csr_from_keys(keys_parts, n, sort_limit if dev.type == "cuda" else min(sort_limit, _CPU_SORT))
    keys_parts.clear()
    graph = Graph(indptr.cpu(), indices.cpu(), validate=False)
    del indices, indptr
    # features, in parallel row chunks
    if callable(features_out):
        features_out = features_out(graph)
    if features_out is None:
        feats = torch.empty((n, spec.num_features), dtype=torch.float32)
    else:
        feats = torch.as_tensor(features_out)
        if tuple(feats.shape) != (n, spec.num_features) or feats.dtype != torch.float32:
            raise DatasetError(f"features_out must be ({n}, {spec.num_features}) float32")
    centroids = torch.randn(spec.num_classes, spec.num_features, generator=_gen(spec.seed, 2, 0, dev), device=dev)
    n_row_chunks = max(1, -(-n // chunk_rows))

    def feature_chunk(i: int, stop: threading.Event | None = None) -> None:
        lo, hi = i * chunk_rows, min(n, (i + 1) * chunk_rows)
        g = _gen(spec.seed, 3, i, dev)
        # on the CPU drawn in pieces of whole 16-value groups: the same numbers as one draw of the chunk
        step = max(16, _PIECE // max(1, spec.num_features) // 16 * 16) if dev.type == "cpu" else hi - lo
        for s in range(lo, hi, step):
            check(stop)
            e = min(hi, s + step)
            x = torch.randn(e - s, spec.num_features, generator=g, device=dev)
            x.add_(centroids[comm.labels[s:e]], alpha=spec.signal)
            feats[s:e].copy_(x)

    _run_chunks(feature_chunk, n_row_chunks, dev, f"{spec.name}: features", progress)
    labels = comm.labels.cpu()
    perm = torch.randperm(n, generator=_gen(spec.seed, 4, 0, torch.device("cpu")))
    n_train, n_val = int(spec.train_frac * n), int(spec.val_frac * n)
    n_test = min(int(spec.test_frac * n), n - n_train - n_val)
    splits = (perm[:n_train].sort().values, perm[n_train:n_train + n_val].sort().values,
              perm[n_train + n_val:n_train + n_val + n_test].sort().values)
    meta = {"generator": "degree-corrected planted partition", "spec": dataclasses.asdict(spec),
            "device": dev.type, "seconds": round(time.perf_counter() - t0, 2)}
    log.info("generated %s: %d nodes, %d CSR edges, %d features in %.1f s", spec.name, n, graph.num_edges,
             spec.num_features, meta["seconds"])
    return Dataset(spec.name, graph, feats, labels, *splits, spec.num_classes, meta)


def _csr_from_keys(parts: list[torch.Tensor], n: int, sort_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (indptr (n+1,) int64, indices int32/int64) of the distinct edge keys ``dst * n + src`` in ``parts``.

    Keys are sorted and deduplicated by destination ranges holding at most ``sort_limit``
    keys each, so graphs with more than 2^31 edge entries can be built on a GPU.
    """
    dev = parts[0].device
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    total = sum(p.numel() for p in parts)
    if total <= sort_limit:
        ranges = [(0, n)]
    else:  # histogram of destinations in coarse buckets, grouped greedily into ranges
        coarse = min(n, max(64, 8 * -(-total // sort_limit)))
        hist = torch.zeros(coarse, dtype=torch.int64, device=dev)
        for p in parts:
            hist += torch.bincount(torch.div(p, n, rounding_mode="floor") * coarse // n, minlength=coarse)
        bounds = [-(-b * n // coarse) for b in range(coarse + 1)]  # first node of each coarse bucket
        ranges, start, acc = [], 0, 0
        for b, c in enumerate(hist.tolist()):
            if acc and acc + c > sort_limit:
                ranges.append((bounds[start], bounds[b]))
                start, acc = b, 0
            acc += c
        ranges.append((bounds[start], n))
    counts = torch.zeros(n, dtype=torch.int64, device=dev)
    pieces = []
    for lo, hi in ranges:
        if (lo, hi) == (0, n):
            sel = torch.cat(parts)
        else:
            sel = torch.cat([p[(p >= lo * n) & (p < hi * n)] for p in parts])
        keys = torch.unique(sel)  # sorted by (dst, src): CSR order, duplicates gone
        del sel
        dst = torch.div(keys, n, rounding_mode="floor")
        pieces.append((keys - dst * n).to(idx_dtype))
        counts[lo:hi] = torch.bincount(dst - lo, minlength=hi - lo)
        del keys, dst
    indptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=indptr[1:])
    return indptr, torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _run_chunks(fn: Any, n: int, dev: torch.device, desc: str, progress: bool) -> None:
    """Run ``fn(i)`` for i in range(n): on a few threads on the CPU (torch releases the GIL), in order on a GPU.

    A Ctrl-C or SIGTERM (`datapath._runtime.interrupts`) stops it within a fraction of a second, even in
    the middle of a chunk."""
    with _progress(n, desc, progress) as bar:
        if dev.type == "cuda":  # one chunk's kernels are queued in milliseconds: Ctrl-C lands between chunks
            for i in range(n):
                fn(i)
                bar.update(1)
            return
        run_chunks(fn, n, on_done=lambda: bar.update(1))
