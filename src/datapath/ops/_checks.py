"""Preconditions of the aggregation kernels: cheap shape checks on every call, value checks in debug mode.

A kernel reads ``x[indices[k]]`` for every CSR position ``k`` of rows ``[0, rows)`` and writes
``out[row]``: it is in bounds when ``indptr`` has ``rows + 1`` entries from 0 up to E, every index
lies in ``[0, num_src)``, ``x`` has the rows and width its launch was made for, and the scale
vectors and edge weights have one entry per source, row and edge.  The launchers check the shapes
on every call (a few hundred nanoseconds: no GPU work).  The values (the CSR's, a source map's,
the long-row schedule's) cost a host synchronisation each: they are checked only in debug mode,
which also compiles the kernels with ``-DDP_DEBUG`` (each kernel then checks its own row and edge
bounds and traps, naming what failed, instead of reading out of bounds).

Debug mode: ``datapath.ops.set_debug_checks(True)`` or ``with datapath.ops.debug_checks():``; the
environment variable ``DATAPATH_OPS_DEBUG=1`` turns it on from the start.  Launches prepared before
it was turned on keep their build (the value checks still run).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from datapath._runtime import settings
from datapath.ops.errors import FeatureShapeError, GraphFormatError, GraphIndexError

_DEBUG = [bool(settings.at_import("DATAPATH_OPS_DEBUG"))]


def debug_checks_enabled() -> bool:
    """Whether the aggregation kernels check their inputs' values (and are built with ``-DDP_DEBUG``)."""
    return _DEBUG[0]


def set_debug_checks(enabled: bool) -> bool:
    """Turn debug checks on or off for the whole process; returns the previous setting."""
    prev = _DEBUG[0]
    _DEBUG[0] = bool(enabled)
    return prev


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """``with debug_checks():`` the calls inside check their inputs' values (synchronising; see the module)."""
    prev = set_debug_checks(enabled)
    try:
        yield
    finally:
        set_debug_checks(prev)


_DEBUG_OPTIONS = ("-DDP_DEBUG",)


def kernel_options() -> tuple[str, ...]:
    """The NVRTC options of the current mode (``-DDP_DEBUG`` in debug mode)."""
    return _DEBUG_OPTIONS if _DEBUG[0] else ()


def rows_error(x: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, what: str) -> FeatureShapeError:
    """The error for features that do not match the launch they were passed to."""
    return FeatureShapeError(
        f"{what}: the rows have shape {tuple(x.shape)} and dtype {x.dtype}, but this launch was made for "
        f"{shape} {dtype} (num_src rows of the graph it aggregates, the planned width); pass rows of that "
        f"shape and dtype (for a gradient: one row per destination of the forward's graph)")


def validate_csr(indptr: torch.Tensor, indices: torch.Tensor, num_src: int, num_rows: int,
                 edge_perm: torch.Tensor | None = None, what: str = "graph") -> None:
    """Raise unless ``indptr`` ((num_rows+1,), 0 .. E, non-decreasing) and ``indices`` (values in
    [0, num_src)) are a valid CSR and ``edge_perm`` (if any) holds E positions in [0, E).  Synchronises."""
    e = indices.numel()
    if indptr.dim() != 1 or indptr.numel() != num_rows + 1:
        raise GraphFormatError(f"{what}: indptr has {indptr.numel()} entries for {num_rows} rows (needs rows + 1)")
    vals = [indptr[0], indptr[-1]]
    if num_rows > 0:
        vals.append((indptr[1:] - indptr[:-1]).min())
    if e > 0:
        vals += list(torch.aminmax(indices))
    if edge_perm is not None and e > 0:
        vals += list(torch.aminmax(edge_perm))
    got = torch.stack([v.to(torch.int64) for v in vals]).tolist()
    if got[0] != 0 or got[1] != e:
        raise GraphFormatError(f"{what}: indptr runs from {got[0]} to {got[1]} but there are {e} indices")
    if num_rows > 0 and got[2] < 0:
        raise GraphFormatError(f"{what}: indptr decreases (a row of negative length)")
    if e > 0:
        i = 3 if num_rows > 0 else 2
        if got[i] < 0 or got[i + 1] >= num_src:
            raise GraphIndexError(f"{what}: indices range over [{got[i]}, {got[i + 1]}] but there are {num_src} "
                                  f"sources")
        if edge_perm is not None and (edge_perm.numel() != e or got[i + 2] < 0 or got[i + 3] >= e):
            raise GraphFormatError(f"{what}: edge_perm must hold {e} positions in [0, {e})")


def validate_ids(ids: torch.Tensor, rows: int, what: str) -> None:
    """Raise unless every id lies in ``[0, rows)``.  Synchronises."""
    if ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= rows:
        raise GraphIndexError(f"{what} range over [{lo}, {hi}] but the table has {rows} rows")


def validate_length(t: torch.Tensor | None, n: int, what: str) -> None:
    """Raise unless ``t`` (if given) holds at least ``n`` entries."""
    if t is not None and t.numel() < n:
        raise FeatureShapeError(f"{what} has {t.numel()} entries but the kernel reads {n}")
