"""The fuzz's checks of the row fetch (`datapath.memory.gather_rows` / `scatter_rows`, ``u[idx]``, ``u[idx] = x``).

Every table placement (cuda, ``to("unified")``, ``as_unified``, ``pin_memory()``, pageable cpu), int32 and
int64 indices of one or two dimensions with repeats and negative values, sorted and unsorted visits, each
launcher of `datapath.memory.gather_config` (native, driver, cupy) in turn: results must equal the CPU
``index_select`` bit for bit.  An out-of-range index must raise ``IndexError`` (at once with ``sync=True``,
else at `datapath.memory.check_errors`), never crash or return garbage without a word.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from datapath import memory
from datapath.testing.fuzz_checks import Checks, DTYPES, _gen, table_for

GATHER_DTYPES = {**DTYPES, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


@contextlib.contextmanager
def launcher(name: str | None) -> Iterator[None]:
    """``gather_config.launcher`` set to ``name`` (None: unchanged) for the block, restored after."""
    cfg = memory.gather_config
    old = cfg.launcher
    if name is not None:
        cfg.launcher = name  # type: ignore[assignment]
    try:
        yield
    finally:
        if name is not None:
            cfg.launcher = old


def _rows(gen: torch.Generator, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, width, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(0, 100, (n, width), generator=gen).to(dtype)


def _exact(got: torch.Tensor, want: torch.Tensor) -> float:
    """0 when equal bit for bit (and of one shape and dtype), else inf."""
    g = got.detach().cpu()
    if g.shape != want.shape or g.dtype != want.dtype:
        return float("inf")
    return 0.0 if torch.equal(g.view(torch.uint8) if g.numel() else g, want.view(torch.uint8) if g.numel() else want) \
        else float("inf")


def check_gather(params: dict[str, Any], device: Any, out: Checks) -> None:
    """A gather or scatter of random rows through the path ``params["path"]``."""
    from datapath.unified_tensor import check_errors  # noqa: PLC0415 - unified_tensor sits above testing

    gen = _gen(params)
    dtype = GATHER_DTYPES[params["dtype"]]
    n, width, m = params["rows"], params["width"], params["count"]
    placement, path = params["table"], params["path"]
    host = _rows(gen, n, width, dtype)
    table = table_for(host.clone(), placement, device)
    idx_dev = device if params.get("cuda_idx", True) else "cpu"
    if path in ("setitem", "scatter"):
        idx = torch.randperm(n, generator=gen)[:m]  # distinct: which of repeated rows lands is unspecified
    else:
        idx = torch.randint(-n if params.get("negative") else 0, n, (m,), generator=gen)
    if params.get("sorted_idx"):
        idx = idx.sort().values
    if params.get("two_d") and m % 2 == 0 and m:
        idx = idx.view(2, m // 2)
    idx = idx.to(torch.int32 if params.get("idx32") else torch.int64)
    bad = params.get("bad")
    if bad:  # one index out of range
        flat = idx.reshape(-1)
        if flat.numel():
            flat[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = n + 3 if bad == "high" else -n - 2
    sort = params.get("sort")
    with launcher(params.get("launcher")):
        if bad:
            _expect_index_error(table, idx.to(idx_dev), path, sort, params.get("sync", True), out, check_errors)
            return
        if path == "getitem":
            got = table[idx.to(idx_dev)]
        elif path == "gather":
            got = memory.gather_rows(table, idx.to(idx_dev), sort=sort, sync=params.get("sync"))
        else:
            new = _rows(gen, m, width, dtype).reshape(*idx.shape, width)
            if path == "setitem":
                table[idx.to(idx_dev)] = new.to(idx_dev) if placement == "cuda" or idx_dev != "cpu" else new
            else:
                memory.scatter_rows(table, idx.to(idx_dev), new.to(idx_dev), sort=sort, sync=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            host[idx.long().reshape(-1)] = new.reshape(-1, width)
            got = memory.host_of(table) if placement != "cuda" else table
            out.append((f"{path}_table", _exact(got.reshape(n, width), host)))
            return
    want = host[idx.long()]
    out.append((path, _exact(got, want)))


def _expect_index_error(table: torch.Tensor, idx: torch.Tensor, path: str, sort: Any, sync: bool, out: Checks,
                        check_errors: Any) -> None:
    """An out-of-range index: ``IndexError`` at once (sync) or at ``check_errors`` (deferred); the context lives on."""
    raised = False
    try:
        zeros = torch.zeros(*idx.shape, *table.shape[1:], dtype=table.dtype, device=idx.device)
        if path == "getitem":
            table[idx]
        elif path == "setitem":
            table[idx] = zeros
        elif path == "scatter":
            memory.scatter_rows(table, idx, zeros, sort=sort, sync=sync)
        else:
            memory.gather_rows(table, idx, sort=sort, sync=sync)
        check_errors()
    except IndexError:
        raised = True
    out.append(("bad_index_raises", 0.0 if raised else float("inf")))
    if torch.cuda.is_available():  # the context must survive
        torch.ones(4, device="cuda").sum().item()
        torch.cuda.synchronize()
