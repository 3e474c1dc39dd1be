"""The one row fetch of datapath: `gather_rows`, `scatter_rows`, `gather_tiered`.

Every table, wherever it lives, goes through here: unified tensors, the loaders' feature
and label gathers, the feature store's tiers, the neural-network layers.

- CUDA indices, table in pinned/unified host memory: a GPU kernel reads the rows straight
  from host memory over PCIe (zero copy; rows aligned to 128-byte lines by circular
  shift; large calls visit rows in sorted order to share address translations);
- CUDA indices, table in GPU memory: the same kernel reading GPU memory;
- CPU indices (or a pageable table): a CPU gather (then a copy to the indices' device).

Indices are int32 or int64 of any shape; negative values count from the end (as in
PyTorch); every index is bounds-checked and no kernel ever reads or writes outside its
table.  A bad CUDA index gives ``IndexError`` naming it and the CUDA context survives (no
device-side assert): at once with ``sync=True``, otherwise (the default, which does not
wait for the GPU) at the thread's next fetch, at `check_errors`, or through the caller's
`ErrorFlag` (see `datapath.memory.bounds`).
"""
from __future__ import annotations

import math
import threading

import torch

from datapath._runtime.pinned import cuda_alias, in_flight
from datapath._runtime.pinned import pending_host_reads as _pending_runtime
from datapath.memory import _launch, _order, _plans
from datapath.memory.bounds import ErrorFlag, current_flag, deferred_flag, raise_deferred, thread_flag
from datapath.memory.config import GATHER_MODES, gather_config
from datapath.memory.host_record import HostRecord, ReadOnlyTableError
from datapath.memory.placement import (
    PlacementError, host_of, is_read_only, is_unified, placement_of, split,
)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(idx: torch.Tensor) -> None:
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"row indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"row indices must be int32 or int64, got {idx.dtype}")
    if not idx.is_cuda and idx.device.type != "cpu":
        raise TypeError(f"row indices must be on CPU or CUDA, got {idx.device}")


def _cpu_rows(n_rows: int, idx: torch.Tensor) -> torch.Tensor:
    """Bounds-checked, non-negative int64 copy of CPU ``idx`` (raises IndexError naming a bad index)."""
    flat = idx.reshape(-1).to(torch.int64)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < -n_rows:
            raise IndexError(f"index {lo} is out of bounds for dimension 0 with size {n_rows}")
        if hi >= n_rows:
            raise IndexError(f"index {hi} is out of bounds for dimension 0 with size {n_rows}")
        flat = torch.where(flat < 0, flat + n_rows, flat)
    return flat


class _SyncFlags(threading.local):
    flag: ErrorFlag | None = None


_sync_flags = _SyncFlags()


def _flag_for(error_flag: ErrorFlag | None, sync: bool | None) -> tuple[ErrorFlag, bool]:
    """(the flag the kernel writes, whether this call waits for it)."""
    if error_flag is not None:
        return error_flag, False
    if gather_config.sync_bounds_check if sync is None else sync:
        if _sync_flags.flag is None:
            _sync_flags.flag = ErrorFlag()
        return _sync_flags.flag, True
    raise_deferred()
    return thread_flag(), False


def _wait_and_raise(flag: ErrorFlag, stream: torch.cuda.Stream) -> None:
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    event.synchronize()
    flag.raise_if_set()


def _finish(flag: ErrorFlag, wait: bool, stream: torch.cuda.Stream, host_owner: torch.Tensor | None) -> None:
    """Wait for the launch and raise (``wait``), or keep the host table alive until the GPU has read it."""
    if wait:
        _wait_and_raise(flag, stream)
    elif host_owner is not None:
        in_flight.hold(stream, host_owner)  # the GPU reads it after we return: keep it alive until then


def pending_host_reads() -> int:
    """How many launches that read or write host memory may still be running (their memory kept alive)."""
    return _pending_runtime() + _plans.pending_host_tables()


def _bounds_check_cuda(flat: torch.Tensor, n_rows: int) -> None:
    """Synchronous bounds check (the generic path for tables whose rows are not contiguous)."""
    if flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat.to(torch.int64)))
        bad = lo if lo < -n_rows else hi if hi >= n_rows else None
        if bad is not None:
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n_rows}")


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on {device}; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def _gather_known_unified(table: torch.Tensor, idx: torch.Tensor, error_flag: ErrorFlag | None,
                          sync: bool | None, sort: bool | None) -> torch.Tensor | None:
    """`gather_rows`'s most common call in one straight line, or None when it is not that call.

    That call: a unified table already fetched from (its `_plans.HostTable` made), 1-D
    contiguous int32/int64 CUDA indices on the current device, no ``out``, the default mode,
    no waiting.  Every decision is the general path's (the same plan, visit-order rule,
    flags and keep-alive), looked up once per (index dtype, device, stream, settings) in
    `_plans.FastGather`; the host time before the launch is what a small call from an idle
    GPU waits for (B1).
    """
    if not isinstance(table, HostRecord) or type(idx) is not torch.Tensor:
        return None
    dev = idx.get_device()  # -1 on the CPU
    if dev < 0 or idx.stride() != (1,):
        return None
    rec = _plans.known_host_table(table._host)
    idx_dtype = idx.dtype
    if rec is None or (idx_dtype is not torch.int64 and idx_dtype is not torch.int32):
        return None
    m = idx.shape[0]
    cfg = gather_config
    if m == 0 or torch._C._cuda_getDevice() != dev:  # noqa: SLF001 - the cheap current-device query
        return None
    if error_flag is None:
        if cfg.sync_bounds_check if sync is None else sync:
            return None
        error_flag = deferred_flag()
    raw = torch._C._cuda_getCurrentRawStream(dev)  # noqa: SLF001 - 0.2 us instead of 2 us
    fast = rec.fast.get((idx_dtype, dev, raw, cfg.version))
    if fast is None:
        fast = rec.fast_gather((idx_dtype, dev, raw, cfg.version))
    sort_it = (m >= fast.sort_from) if sort is None else cfg.sorts(m, rec.row_bytes, rec.table_bytes, sort, True)
    return _launch_known(rec, fast, idx, m, error_flag, sort_it)


def _launch_known(rec: _plans.HostTable, fast: _plans.FastGather, idx: torch.Tensor, m: int, flag: ErrorFlag,
                  sort_it: bool) -> torch.Tensor:
    """Queue the gather of the ``m`` rows ``idx`` (1-D contiguous, ``fast``'s dtype, device and stream) from
    ``rec``'s table as ``fast`` plans it: in sorted order (``sort_it``) or in the caller's (the native launcher
    first); returns the (m, *rest) output."""
    if sort_it:
        # the ordering is launched first: the output is made while it runs (an idle GPU waits for every step)
        visit = _order.sorted_visit(idx, rec.n_rows)
        out = fast.like.new_empty((m, *fast.rest))
        out_ptr = out.data_ptr()
        plan = fast.plan if not out_ptr & (rec.w - 1) else rec.narrow_plan(fast, out_ptr)
        plan.launch(rec.ptr, rec.n_rows, visit[1], visit[2], m, out_ptr, flag.ptr, fast.stream)
        return out
    nat = fast.native
    if nat is _plans.PENDING:
        nat = _plans.native_plan(rec, fast)
    if nat is not None:  # the visit order is decided: no row limit
        rows = nat(idx, flag.ptr, _plans.NO_LIMIT)
        if rows is not None:
            return rows
    out = fast.like.new_empty((m, *fast.rest))
    out_ptr = out.data_ptr()
    plan = fast.plan if not out_ptr & (rec.w - 1) else rec.narrow_plan(fast, out_ptr)
    plan.launch_plain(rec.ptr, rec.n_rows, idx.data_ptr(), m, out_ptr, flag.ptr, fast.stream)
    return out


_tables = _plans._tables  # noqa: SLF001 - the host tables' records, read once per call below
# the cheap queries (0.1 us instead of 2 us); a CPU-only PyTorch has neither, and never reaches them
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # noqa: SLF001
_current_device = getattr(torch._C, "_cuda_getDevice", None)  # noqa: SLF001


def take_rows(table: HostRecord, idx: torch.Tensor) -> torch.Tensor | None:
    """``table[idx]`` for `UnifiedTensor.__getitem__` (``gather_rows(table, idx)``); None when ``idx`` is not a
    CUDA integer tensor (the caller indexes as PyTorch does).

    A small call from an idle GPU waits for every step before the launch (B1), so the call that
    repeats the table's last one (`_plans.HostTable.last`: same index dtype, device, stream and
    settings; 1-D contiguous indices; no waiting) checks just that and launches: through the
    native launcher where it is built (the indices' checks, the allocation and the launch in one
    C++ call, for fewer rows than sort), else from Python.
    """
    if type(idx) is not torch.Tensor:
        return None
    host = table._host
    rec = _tables.get(id(host))
    if rec is not None:
        fast = rec.last
        if (fast is not None and fast.version == gather_config.version and fast.stream == _raw_stream(fast.device)
                and _current_device() == fast.device and rec.ptr == host.data_ptr() and rec.shape == host.shape):
            nat = fast.native  # the native launcher checks the indices, allocates and launches in one call
            if nat is _plans.PENDING:
                nat = _plans.native_plan(rec, fast)
            if nat is not None:
                flag = current_flag()
                out = nat(idx, flag.ptr, fast.sort_limit) if flag is not None else None
                if out is not None:
                    return out
            m = idx.shape[0] if idx.stride() == (1,) else 0  # 1-D contiguous indices only
            if m and not fast.waits and idx.get_device() == fast.device and idx.dtype is fast.dtype:
                return _launch_known(rec, fast, idx, m, deferred_flag(), m >= fast.sort_from)
    if not idx.is_cuda or idx.dtype not in _INDEX_DTYPES:
        return None
    rows = _gather_known_unified(table, idx, None, None, None)
    return rows if rows is not None else gather_rows(table, idx)


def gather_rows(table: torch.Tensor, idx: torch.Tensor, error_flag: ErrorFlag | None = None, *,
                out: torch.Tensor | None = None, sync: bool | None = None, mode: str | None = None,
                sort: bool | None = None) -> torch.Tensor:
    """``table[idx]`` (rows along dimension 0), bounds-checked, whatever memory ``table`` is in.

    Args:
        table: (N, *rest) tensor: CUDA, unified, pinned CPU, or pageable CPU; any dtype.
        idx: int32/int64 indices of any shape, on CPU or CUDA.
        error_flag: record a bad CUDA index in this `ErrorFlag` (checked by the caller) instead of
            the thread's flag; the call never waits.
        out: contiguous CUDA tensor of the result's shape and dtype to write into (GPU path).
        sync: wait for the kernel and raise ``IndexError`` now (default ``gather_config.sync_bounds_check``).
        mode: alignment scheme of the kernel (default ``gather_config.gather_mode``).
        sort: visit rows in sorted index order (default: ``gather_config.sort_indices``).

    Returns:
        (*idx.shape, *rest) tensor of ``table``'s dtype: on CUDA for CUDA indices or a CUDA table,
        else on the CPU.
    """
    if out is None and mode is None:
        rows = _gather_known_unified(table, idx, error_flag, sync, sort)
        if rows is not None:
            return rows
    _check_index(idx)
    where, data = split(table)
    if data.dim() == 0:
        raise IndexError("cannot gather rows of a 0-dimensional tensor")
    rest = data.shape[1:]
    if where == "cuda" and idx.device != data.device:
        idx = idx.to(data.device)
    if not idx.is_cuda:
        if out is not None:
            raise ValueError("out= is for the GPU gather (CUDA indices or a CUDA table)")
        rows = torch.index_select(data, 0, _cpu_rows(data.shape[0], idx))
        return rows.reshape(*idx.shape, *rest)
    if where == "cpu":  # pageable: the CPU gathers, then one copy (the DGL/PyG default path)
        rows = torch.index_select(data, 0, _cpu_rows(data.shape[0], idx.cpu()))
        if out is None:
            return rows.reshape(*idx.shape, *rest).to(idx.device)
        _check_out(out, (*idx.shape, *rest), data.dtype, idx.device)
        return out.copy_(rows.reshape(out.shape))
    flat = idx if idx.dim() == 1 and idx.is_contiguous() else idx.reshape(-1).contiguous()
    m = flat.numel()
    if out is None:
        out = flat.new_empty((m, *rest), dtype=data.dtype)
    else:
        _check_out(out, (*idx.shape, *rest), data.dtype, idx.device)
        out = out.view(m, *rest)
    if m:
        _launch_rows("gather", data, flat, out, where, error_flag, sync, mode, sort)
    return out if idx.dim() == 1 else out.view(*idx.shape, *rest)


def scatter_rows(table: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, *, sync: bool | None = None,
                 mode: str | None = None, sort: bool | None = None) -> None:
    """``table[idx] = rows``: write rows into ``table`` wherever it lives (host memory written by the GPU over PCIe).

    Args:
        table: (N, *rest) CUDA, unified or pinned tensor (pageable CPU: CPU indices only).
        idx: int32/int64 indices of any shape, CUDA or CPU.
        rows: values broadcastable to (*idx.shape, *rest), of the table's dtype.

    With repeated indices, which of the rows lands is unspecified (as in PyTorch).  GPU
    writes are asynchronous: synchronize before reading a host table on the CPU.

    Raises:
        ReadOnlyTableError: the table's memory is read-only.
    """
    _check_index(idx)
    if is_read_only(table):
        raise ReadOnlyTableError(
            "cannot write rows into a read-only table (a read-only memory mapping or a numpy array that is not "
            "writeable); copy it first: t.to('unified'), or np.load(path) without mmap_mode='r'")
    where = placement_of(table)
    data = table if where == "cuda" else host_of(table)
    if data.dim() == 0:
        raise IndexError("cannot scatter rows into a 0-dimensional tensor")
    rest = tuple(data.shape[1:])
    if rows.dtype != data.dtype:
        raise TypeError(f"rows have dtype {rows.dtype} but the table has {data.dtype}")
    if where == "cuda" and idx.device != data.device:
        idx = idx.to(data.device)
    if is_unified(rows):
        rows = host_of(rows)
    if idx.device.type == "cpu":
        flat = _cpu_rows(data.shape[0], idx)
        data.index_copy_(0, flat, rows.to("cpu").expand(*idx.shape, *rest).reshape(-1, *rest))
        return
    if where == "cpu":
        raise PlacementError("a GPU scatter writes host memory over PCIe and needs pinned memory: make the table "
                             "with t.to('unified') or datapath.unified_tensor.as_unified(t), or pass CPU indices")
    flat = idx.reshape(-1).contiguous()
    if not flat.numel():
        return
    src = rows.to(idx.device).expand(*idx.shape, *rest).reshape(flat.numel(), *rest).contiguous()
    _launch_rows("scatter", data, flat, src, where, None, sync, mode, sort)


def _launch_rows(direction: str, data: torch.Tensor, flat: torch.Tensor, dev_rows: torch.Tensor, where: str,
                 error_flag: ErrorFlag | None, sync: bool | None, mode: str | None, sort: bool | None) -> None:
    """One kernel launch (three with a sorted visit order) moving rows ``flat`` between ``data`` and ``dev_rows``.

    What depends only on the table and the row geometry is worked out once and cached
    (`datapath.memory._plans`); nothing here waits for the GPU unless ``sync`` asks for it.
    """
    mode_id = GATHER_MODES.get(gather_config.gather_mode if mode is None else mode)
    if mode_id is None:
        raise ValueError(f"mode must be one of {sorted(GATHER_MODES)}, got {mode!r}")
    on_host = where != "cuda"
    dev = flat.get_device()
    out_ptr = dev_rows.data_ptr()
    switch = torch._C._cuda_getDevice() != dev  # noqa: SLF001 - the cheap current-device query
    guard = torch.cuda.device(dev) if switch else None
    if guard is not None:
        guard.__enter__()
    try:
        if on_host:
            rec = _plans.host_table(data)
            if rec is None:
                return _launch_generic(direction, data, flat, dev_rows, on_host)
            w = rec.w if not out_ptr & (rec.w - 1) else _plans.word_width(rec.w, out_ptr)
            plan = rec.plan(direction, flat.dtype, mode_id, dev, w)
            n_rows, row_bytes, table_bytes = rec.n_rows, rec.row_bytes, rec.table_bytes
        else:
            layout = _launch.row_layout(data)
            if layout is None:
                return _launch_generic(direction, data, flat, dev_rows, on_host)
            row_bytes, row_stride = layout
            n_rows, table_bytes = data.shape[0], data.shape[0] * row_stride
            w = _plans.word_width(row_bytes, row_stride, data.data_ptr(), out_ptr)
            plan = _plans.plan_for(direction, flat.dtype, mode_id, dev, False, row_bytes, row_stride, w)
        flag, wait = _flag_for(error_flag, sync)
        m = flat.numel()
        if gather_config.sorts(m, row_bytes, table_bytes, sort, on_host):
            visit = _order.sorted_visit(flat, n_rows)
            idx_ptr, order_ptr = visit[1], visit[2]
        else:
            idx_ptr, order_ptr = flat.data_ptr(), 0
        key, stream = _plans.current_stream(dev)
        plan.launch(data.data_ptr(), n_rows, idx_ptr, order_ptr, m, out_ptr, flag.ptr, key[1])
        if on_host and key not in rec.streams:
            rec.streams[key] = stream  # the table's memory is kept until the work queued there is done
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
    if wait:
        _wait_and_raise(flag, stream)
    return None


def _launch_generic(direction: str, data: torch.Tensor, flat: torch.Tensor, dev_rows: torch.Tensor,
                    on_host: bool) -> None:
    """Rows that are not contiguous in memory: PyTorch's index ops, bounds checked synchronously."""
    n_rows = data.shape[0]
    _bounds_check_cuda(flat, n_rows)
    view = cuda_alias(data) if on_host else data
    wrapped = flat.to(torch.int64).remainder(max(n_rows, 1))
    if direction == "gather":
        dev_rows.copy_(torch.index_select(view, 0, wrapped))
    else:
        view.index_copy_(0, wrapped, dev_rows)
    if on_host:
        in_flight.hold(torch.cuda.current_stream(flat.device), data)


def gather_tiered(a: torch.Tensor, b: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, *,
                  error_flag: ErrorFlag | None = None, counts: torch.Tensor | None = None,
                  sort: bool | None = None) -> torch.Tensor:
    """``out[k]`` = row ``loc[k] - 1`` of ``a`` or row ``loc[k] - 1 - len(a)`` of ``b``, in one launch.

    The feature store's GPU cache (``a``, CUDA) and host tier (``b``, pinned) read by one
    kernel.  ``loc[k] < 0`` leaves ``out[k]`` alone (another tier fills it), ``loc[k] == 0``
    writes zeros (an index already found out of range).

    Args:
        a: (Na, *rest) CUDA (or, without CUDA, CPU) table; b: (Nb, *rest) pinned/unified/CUDA table.
        loc: (m,) int32 slots, on ``out``'s device.
        out: (m, *rest) contiguous output.
        counts: (3,) int64 accumulating rows taken from a, from b, and left to other tiers.
    Returns:
        ``out``.
    """
    if loc.dim() != 1 or loc.dtype != torch.int32 or out.shape[0] != loc.numel():
        raise ValueError(f"loc must be (m,) int32 with m = out.shape[0]; got {loc.dtype} {tuple(loc.shape)}")
    b_data = b if placement_of(b) == "cuda" else host_of(b)
    if loc.device.type == "cpu":
        return _gather_tiered_cpu(a, b_data, loc, out, counts)
    flag, wait = _flag_for(error_flag, False)
    stream = torch.cuda.current_stream(loc.device)
    b_on_host = b_data.device.type == "cpu"
    if b_on_host and b_data.numel() and not b_data.is_pinned():
        raise PlacementError("the host tier of a tiered gather must be pinned (unified) memory")
    for name, t in (("a", a), ("b", b_data)):
        if t.numel() and (_launch.row_layout(t) is None or t.shape[1:] != out.shape[1:]):
            raise ValueError(f"table {name} of a tiered gather needs contiguous rows shaped like out's "
                             f"{tuple(out.shape[1:])}, got {tuple(t.shape)} with strides {t.stride()}")
    if loc.numel() == 0:
        return out
    row_bytes = math.prod(out.shape[1:]) * out.element_size()
    with torch.cuda.device(loc.device):
        _launch.launch_tiered(a, b_data, loc, out, flag_ptr=flag.ptr, counts=counts, b_on_host=b_on_host,
                              sort=gather_config.sorts(loc.numel(), row_bytes, b_data.shape[0] * row_bytes, sort,
                                                       b_on_host))
    _finish(flag, wait, stream, b_data if b_on_host and b_data.numel() else None)
    return out


def _gather_tiered_cpu(a: torch.Tensor, b: torch.Tensor, loc: torch.Tensor, out: torch.Tensor,
                       counts: torch.Tensor | None) -> torch.Tensor:
    """The CPU twin of the tiered kernel (machines without CUDA)."""
    na, nb = a.shape[0], b.shape[0]
    v = loc.to(torch.int64)
    in_a = (v >= 1) & (v <= na)
    in_b = (v > na) & (v <= na + nb)
    bad = ~(in_a | in_b | (v < 0))
    pa, pb = in_a.nonzero().squeeze(1), in_b.nonzero().squeeze(1)
    out[pa] = a.index_select(0, v[pa] - 1).to(out.dtype)
    out[pb] = b.index_select(0, v[pb] - 1 - na).to(out.dtype)
    if bool(bad.any()):
        out[bad.nonzero().squeeze(1)] = 0
    if counts is not None:
        counts += torch.tensor([pa.numel(), pb.numel(), int((v < 0).sum())], dtype=counts.dtype)
    return out
