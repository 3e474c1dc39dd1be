"""Row gather and scatter between a host table and the GPU.

`gather(table, idx)` returns ``table[idx]``:

- ``idx`` on CUDA: the rows are read by a GPU kernel straight from the table's
  pinned host memory (zero copy, no CPU gather, no staging buffer), with
  128-byte circular-shift alignment, into a new CUDA tensor;
- ``idx`` on the CPU: an ordinary CPU gather.

`scatter(table, idx, rows)` is the write direction: ``table[idx] = rows``.

``table`` is a unified tensor or a CPU tensor (pinned, for the GPU path), of any
number of dimensions; dimension 0 indexes rows.  Indices are int32 or int64 of any
shape, negative values count from the end as in PyTorch, and every index is
bounds-checked: a bad one raises ``IndexError`` naming its value, and the kernel
never touches memory outside the table.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from datapath._runtime import kernels
from datapath._runtime.pinned import fetch_to_host, in_flight
from datapath.unified_tensor._config import GATHER_MODES, config

_NO_ERROR = -(2**63)
_WIDTHS = (16, 8, 4, 2, 1)


class _PendingErrors:
    """Error flags of asynchronously checked launches (``config.sync_bounds_check = False``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: list[tuple[torch.Tensor, int]] = []

    def add(self, flag: torch.Tensor, n_rows: int) -> None:
        with self._lock:
            self._flags.append((flag, n_rows))

    def raise_any(self) -> None:
        with self._lock:
            flags, self._flags = self._flags, []
        for flag, n_rows in flags:
            _raise_if_bad(flag, n_rows)


_pending = _PendingErrors()


def check_errors() -> None:
    """Raise ``IndexError`` for any out-of-range index seen by an unchecked launch so far (waits for them)."""
    _pending.raise_any()


class ErrorFlag:
    """Where a GPU gather that does not wait records an out-of-range index (see `gather`'s ``error_flag``).

    A pinned, GPU-mapped host word: the kernel writes a bad index straight into host memory,
    so once the kernel has finished the host reads it without touching a CUDA stream (no
    synchronisation, no GIL held while the GPU works).  One flag may serve several launches;
    call `raise_if_set` after they are done.
    """

    def __init__(self) -> None:
        from datapath._runtime.pinned import pinned_empty  # noqa: PLC0415

        self.host = pinned_empty((1,), torch.int64)
        self.host.fill_(_NO_ERROR)
        self._sizes: set[int] = set()

    def raise_if_set(self) -> None:
        """Raise ``IndexError`` if a finished launch saw an out-of-range index (the caller waited for it)."""
        bad = int(self.host[0])
        if bad != _NO_ERROR:
            self.host.fill_(_NO_ERROR)
            sizes = " or ".join(str(n) for n in sorted(self._sizes))
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {sizes}")


def _raise_if_bad(flag: torch.Tensor, n_rows: int) -> None:
    bad = int(flag.item())
    if bad != _NO_ERROR:
        raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n_rows}")


def _host_of(table: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(host tensor, known to be pinned) for a unified or CPU table."""
    from datapath.unified_tensor.tensor import UnifiedTensor  # noqa: PLC0415 - import cycle

    if isinstance(table, UnifiedTensor):  # pinned by construction whenever CUDA is present
        return table._host, True
    if table.device.type != "cpu":
        raise TypeError(f"gather/scatter need a unified or CPU table, got one on {table.device}")
    return table, False


def _check_index(idx: torch.Tensor) -> None:
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"row indices must be int32 or int64, got {idx.dtype}")


def _cpu_rows(n_rows: int, idx: torch.Tensor) -> torch.Tensor:
    """Bounds-checked, non-negative int64 copy of CPU ``idx``."""
    flat = idx.reshape(-1).to(torch.int64)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < -n_rows:
            raise IndexError(f"index {lo} is out of bounds for dimension 0 with size {n_rows}")
        if hi >= n_rows:
            raise IndexError(f"index {hi} is out of bounds for dimension 0 with size {n_rows}")
        flat = torch.where(flat < 0, flat + n_rows, flat)
    return flat


def _row_layout(host: torch.Tensor) -> tuple[int, int] | None:
    """(row_bytes, row_stride_bytes) if each row is contiguous in memory, else None."""
    if host.dim() == 0:
        return None
    expected = 1
    for size, stride in zip(reversed(host.shape[1:]), reversed(host.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    es = host.element_size()
    return expected * es, host.stride(0) * es


def _word_bytes(*values: int) -> int:
    for w in _WIDTHS:
        if all(v % w == 0 for v in values):
            return w
    return 1


def _sorts(m: int, table_bytes: int, sort: bool | None) -> bool:
    """Whether to visit the rows in sorted index order (see ``UnifiedConfig.sort_indices``)."""
    choice = config.sort_indices if sort is None else sort
    if choice == "auto":
        return m >= config.sort_min_rows and table_bytes >= config.sort_min_table_bytes
    return bool(choice)


def _launch_rows(direction: str, host: torch.Tensor, idx: torch.Tensor, dev_rows: torch.Tensor,
                 mode: str | None, sort: bool | None = None, error_flag: ErrorFlag | None = None) -> None:
    """Run the gather (host -> dev_rows) or scatter (dev_rows -> host) kernel for flat CUDA ``idx``."""
    layout = _row_layout(host)
    if layout is None:
        raise AssertionError("caller must route non-row-contiguous tables to the generic path")
    row_bytes, row_stride = layout
    n_rows, m = host.shape[0], idx.numel()
    mode = config.gather_mode if mode is None else mode
    if mode not in GATHER_MODES:
        raise ValueError(f"mode must be one of {sorted(GATHER_MODES)}, got {mode!r}")
    w = _word_bytes(row_bytes, row_stride, host.data_ptr(), dev_rows.data_ptr())
    words = row_bytes // w
    g = 32 if words >= 32 else 1 << max(0, (words - 1).bit_length())
    tpb = config.threads_per_block
    groups_per_block = tpb // g
    max_blocks = kernels.multiprocessor_count(idx.device.index) * config.blocks_per_sm
    blocks = max(1, min(-(-m // groups_per_block), max_blocks))
    order = None
    if _sorts(m, n_rows * row_stride, sort):
        idx, order = torch.sort(idx)
    fn = _kernel(direction, w, GATHER_MODES[mode], idx.dtype == torch.int32)
    stream = torch.cuda.current_stream(idx.device)
    sync = config.sync_bounds_check and error_flag is None
    if error_flag is not None:
        error_flag._sizes.add(n_rows)
        flag = error_flag.host
    elif sync:
        flag = _stream_flag(stream)
    else:
        flag = torch.full((1,), _NO_ERROR, dtype=torch.int64, device=idx.device)
    kernels.launch(
        fn, blocks, tpb,
        (kernels.ptr(host), np.int64(n_rows), np.int64(row_stride), np.int64(row_bytes),
         kernels.ptr(idx), kernels.ptr(0 if order is None else order), np.int64(m),
         kernels.ptr(dev_rows), np.int32(g), kernels.ptr(flag)),
        stream=stream,
    )
    if sync:  # reading the flag waits for the kernel: nothing can be freed under it
        bad = int(fetch_to_host(flag)[0])  # sleeps with the GIL released (a loader thread beside training)
        if bad != _NO_ERROR:
            flag.fill_(_NO_ERROR)
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n_rows}")
    else:
        in_flight.hold(stream, host, idx, dev_rows, order, flag)
        if error_flag is None:
            _pending.add(flag, n_rows)


_kernel_cache: dict[tuple[str, int, int, bool, int], object] = {}
_flag_cache: dict[tuple[int, int], torch.Tensor] = {}


def _kernel(direction: str, width: int, mode: int, int32: bool) -> object:
    key = (direction, width, mode, int32, torch.cuda.current_device())
    fn = _kernel_cache.get(key)
    if fn is None:
        fn = kernels.get_function("gather.cu", f"{direction}_w{width}_m{mode}_{'i32' if int32 else 'i64'}")
        _kernel_cache[key] = fn
    return fn


def _stream_flag(stream: torch.cuda.Stream) -> torch.Tensor:
    """The error flag reused by synchronously checked launches on ``stream`` (one per stream)."""
    key = (stream.device.index, stream.cuda_stream)
    flag = _flag_cache.get(key)
    if flag is None:
        flag = torch.full((1,), _NO_ERROR, dtype=torch.int64, device=stream.device)
        _flag_cache[key] = flag
    return flag


def _prepare_cuda_index(host: torch.Tensor, idx: torch.Tensor, pinned: bool, deferred: bool = False) -> torch.Tensor:
    _check_index(idx)
    if not pinned and not host.is_pinned():
        raise ValueError(
            "the GPU gather reads the table over PCIe and needs pinned memory: make it with "
            "t.to('unified') or datapath.unified_tensor.as_unified(t)"
        )
    if not config.sync_bounds_check and not deferred:
        _pending.raise_any()
    return idx.reshape(-1).contiguous()


def gather(table: torch.Tensor, idx: torch.Tensor, mode: str | None = None,
           out: torch.Tensor | None = None, sort: bool | None = None,
           error_flag: ErrorFlag | None = None) -> torch.Tensor:
    """``table[idx]`` for row indices ``idx``.

    Args:
        table: (N, *rest) unified tensor or CPU tensor (pinned for a CUDA ``idx``), any dtype.
        idx: int32/int64 indices of any shape, on CUDA (GPU zero-copy gather) or CPU.
        mode: alignment scheme for the GPU kernel (default ``config.gather_mode``).
        out: optional contiguous CUDA tensor of the result's shape and dtype to write into
            (a preallocated batch buffer); GPU path only.
        sort: visit rows in sorted index order (True/False; default ``config.sort_indices``).
        error_flag: an `ErrorFlag` (GPU path, row-contiguous tables):
            the call returns without waiting for the kernel whatever ``config.sync_bounds_check``
            says, and an out-of-range index is recorded in the flag; the caller must call
            ``error_flag.raise_if_set()`` once the kernel is done (e.g. after an event on the
            current stream).  For pipelines whose indices are known valid and that must not block.

    Returns:
        (*idx.shape, *rest) tensor on ``idx``'s device (a plain CPU tensor for a CPU ``idx``).
    """
    host, pinned = _host_of(table)
    if host.dim() == 0:
        raise IndexError("cannot gather rows of a 0-dimensional tensor")
    rest = tuple(host.shape[1:])
    if idx.device.type == "cpu":
        if out is not None:
            raise ValueError("out= is for the GPU gather (CUDA indices)")
        _check_index(idx)
        rows = _cpu_rows(host.shape[0], idx)
        return torch.index_select(host, 0, rows).reshape(*idx.shape, *rest)
    if idx.device.type != "cuda":
        raise TypeError(f"indices must be on CPU or CUDA, got {idx.device}")
    flat = _prepare_cuda_index(host, idx, pinned, deferred=error_flag is not None)
    shape = (*idx.shape, *rest)
    if out is None:
        out = torch.empty((flat.numel(), *rest), dtype=host.dtype, device=idx.device)
    else:
        if out.shape != shape or out.dtype != host.dtype or out.device != idx.device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {host.dtype} tensor of shape {shape} on {idx.device}; "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        out = out.view(flat.numel(), *rest)
    if flat.numel():
        if _row_layout(host) is None:  # rows not contiguous in memory: generic zero-copy path
            from datapath._runtime.pinned import cuda_alias  # noqa: PLC0415

            _bounds_check_cuda(flat, host.shape[0])
            out.copy_(torch.index_select(cuda_alias(host), 0, flat.remainder(max(host.shape[0], 1))))
            in_flight.hold(torch.cuda.current_stream(idx.device), host)
        else:
            with torch.cuda.device(idx.device):
                _launch_rows("gather", host, flat, out, mode, sort, error_flag)
    return out.view(shape)


def _bounds_check_cuda(flat: torch.Tensor, n_rows: int) -> None:
    if flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat.to(torch.int64)))
        bad = lo if lo < -n_rows else hi if hi >= n_rows else None
        if bad is not None:
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {n_rows}")


def scatter(table: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, mode: str | None = None,
            sort: bool | None = None) -> None:
    """``table[idx] = rows``, writing into the table's host memory.

    Args:
        table: (N, *rest) unified tensor or CPU tensor (pinned for a CUDA ``idx``).
        idx: int32/int64 indices of any shape, CUDA (the GPU writes the rows into host
            memory over PCIe) or CPU.
        rows: values broadcastable to (*idx.shape, *rest), same dtype as the table.

    With repeated indices, which of the rows lands is unspecified (as in PyTorch).
    GPU writes are asynchronous: synchronize the stream before reading the table on the CPU.
    """
    host, pinned = _host_of(table)
    if host.dim() == 0:
        raise IndexError("cannot scatter rows into a 0-dimensional tensor")
    rest = tuple(host.shape[1:])
    if rows.dtype != host.dtype:
        raise TypeError(f"rows have dtype {rows.dtype} but the table has {host.dtype}")
    if idx.device.type == "cpu":
        _check_index(idx)
        flat = _cpu_rows(host.shape[0], idx)
        src = rows.to("cpu").expand(*idx.shape, *rest).reshape(-1, *rest)
        host.index_copy_(0, flat, src)
        return
    flat = _prepare_cuda_index(host, idx, pinned)
    if not flat.numel():
        return
    src = rows.to(idx.device).expand(*idx.shape, *rest).reshape(flat.numel(), *rest).contiguous()
    if _row_layout(host) is None:
        from datapath._runtime.pinned import cuda_alias  # noqa: PLC0415

        _bounds_check_cuda(flat, host.shape[0])
        cuda_alias(host).index_copy_(0, flat.to(torch.int64).remainder(host.shape[0]), src)
        in_flight.hold(torch.cuda.current_stream(idx.device), host)
        return
    with torch.cuda.device(idx.device):
        _launch_rows("scatter", host, flat, src, mode, sort)

