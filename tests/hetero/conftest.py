"""Random heterogeneous graphs for the hetero tests (IGBH-like types, random ids, varied degrees)."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from datapath.graph import HeteroGraph


def make_hetero(seed: int = 0, scale: int = 1) -> tuple[HeteroGraph, dict[str, int], dict]:
    """A HeteroGraph of paper/author/institute/fos with 5 relations (two reverse), and its edge_index dict."""
    g = torch.Generator().manual_seed(seed)
    n = {"paper": 60 * scale, "author": 40 * scale, "institute": 7 * scale, "fos": 11 * scale}

    def rel(s: str, d: str, e: int) -> torch.Tensor:
        # skewed sources (power-law-ish) so that degrees vary and some rows are empty
        src = (torch.rand(e, generator=g) ** 2 * n[s]).long().clamp_(max=n[s] - 1)
        dst = torch.randint(0, n[d], (e,), generator=g)
        return torch.stack([src, dst])

    writes = rel("author", "paper", 150 * scale)
    eid = {
        ("paper", "cites", "paper"): rel("paper", "paper", 240 * scale),
        ("author", "writes", "paper"): writes,
        ("paper", "rev_writes", "author"): writes.flip(0),
        ("author", "affiliated", "institute"): rel("author", "institute", 50 * scale),
        ("paper", "topic", "fos"): rel("paper", "fos", 90 * scale),
    }
    return HeteroGraph(n, eid), n, eid


@pytest.fixture
def hetero() -> Callable[..., tuple[HeteroGraph, dict[str, int], dict]]:
    return make_hetero
