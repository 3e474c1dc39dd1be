"""The sum-family aggregation on CUDA by the ``rows``, ``tensor_core`` and ``cusparse`` kernels.

Each computes, over a `CSRView` (a graph, or its transposed view for the gradient)::

    out[r, :] = row_scale[r] * sum_{k in row r} w[e(k)] * nbr_scale[indices[k]] * x[map(indices[k]), :]

with ``e(k) = edge_perm[k]`` on a transposed view (the weight of the original edge), any
factor absent when its tensor is None, ``map`` the optional ``src_map``; ``x`` (rows, F) is
contiguous, ``w`` (E,) float32 (float64 for float64 x), the result (num_dst, F) in x's dtype,
accumulated in float32 (float64).  Everything a kernel needs besides its inputs is built
once per view and kept in its cache; no function here synchronises with the host except
the tensor-core translation (once per graph).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from datapath.ops import _checks, _launch
from datapath.ops._graph import CSRView, Ref
from datapath.ops._launch import aligned_vec, launch, ptr
from datapath.ops._sgt import Translation, translate
from datapath.ops.plan import AggregationPlan, _next_pow2, widest_vec

ROWS_THREADS = 256
_DEBUG = _checks._DEBUG  # noqa: SLF001 - the debug switch, read once per call


def _row_order(view: CSRView) -> torch.Tensor:
    """(num_dst,) int64 rows by descending length (a GPU sort once per view, kept with it; no host sync)."""
    return view.cached("rows_by_degree", lambda: torch.argsort(view.in_degrees(), descending=True))


def _edge_row(view: CSRView) -> torch.Tensor:
    """(num_edges,) int32 row of each CSR position (built once per view, kept with it; no host sync)."""
    def make() -> torch.Tensor:
        rows = torch.arange(view.num_dst, dtype=torch.int32, device=view.device)
        return torch.repeat_interleave(rows, view.in_degrees(), output_size=view.num_edges)
    return view.cached("edge_row", make)


LONG_ROWS_BOUND_BYTES = 64 << 20
"""Largest long-row buffer sized by the bound num_edges // (cut + 1) on their count; past it they are counted
(one host sync, once per view and cut)."""


def _long_rows(view: CSRView, cut: int, row_bytes: int) -> tuple[torch.Tensor, int]:
    """The rows longer than ``cut`` edges, numbered on the GPU: ``long_slot`` (num_dst,) int32, each row's number
    among them (-1: not long), and ``slots``, at least their count: min(num_dst, num_edges // (cut + 1)) without a
    host sync where that many rows of ``row_bytes`` take at most `LONG_ROWS_BOUND_BYTES`, else the count."""
    def make() -> tuple[torch.Tensor, int]:
        long = view.in_degrees() > cut
        count = torch.cumsum(long, 0)  # long rows up to and including each row
        return torch.where(long, count - 1, -1).to(torch.int32), count
    long_slot, count = view.cached(("long_rows", cut), make)
    slots = max(1, min(view.num_dst, view.num_edges // (cut + 1)))
    if slots * row_bytes > LONG_ROWS_BOUND_BYTES:
        slots = max(1, int(count[-1]))  # a large graph: its long rows counted once
    return long_slot, slots


def _tail_cum(view: CSRView, cut: int) -> torch.Tensor:
    """(num_dst,) inclusive prefix sum of the extra pieces (beyond the first ``cut`` edges) of each row."""
    def make() -> torch.Tensor:
        extra = torch.div(view.in_degrees() + (cut - 1), cut, rounding_mode="floor").sub_(1).clamp_(min=0)
        return torch.cumsum(extra, 0)
    return view.cached(("tail_cum", cut), make)


LONG_ROWS_STREAMS = 8
"""Streams a launch keeps a long-row buffer for (a ninth frees the oldest stream's)."""


class _RowsLaunch:
    """Everything about a row-split launch that does not change between calls (kept with the view).

    Graphs with rows longer than the plan's cut get one launch all the same (see ``spmm_rows.cu``): the long rows'
    pieces add into a float32 (float64) buffer of one row per long row, with a counter per row and column chunk,
    that the kernel leaves zero; a pair is kept per CUDA stream (calls on one stream run one after another)."""

    __slots__ = ("head", "multi", "slots", "chunks", "feat", "acc", "buffers", "n", "num_src", "dtype", "in_shape",
                 "csr", "schedule", "tail_pieces")

    def __init__(self, view: CSRView, dtype: torch.dtype, f: int, vec: int, dw: int, cf: int,
                 plan: AggregationPlan) -> None:
        """``vec``, ``dw``, ``cf``: the plan's, or narrower ones for a misaligned x; the rest from ``plan``.

        Every tensor the launch reads besides a call's own (the view's CSR, the row order, the long-row
        schedule) is passed to its `PackedLaunch` as a tensor, which holds it: the launch stays valid however
        long it is kept, whatever happens to the view (a backward may run after its graph was dropped)."""
        n, cut, rows_per_team = view.num_dst, plan.cut, plan.rows_per_team
        self.n, self.num_src, self.dtype = n, view.num_src, dtype
        self.in_shape = torch.Size((view.num_src, f))
        self.csr = (view.indptr, view.indices, view.edge_perm)
        self.schedule: tuple = ()
        self.tail_pieces = 0
        self.chunks = chunks = -(-f // (dw * vec * cf))
        self.feat, self.acc = f, torch.float64 if dtype == torch.float64 else torch.float32
        self.multi = multi = rows_per_team > 1  # several rows a team, every edge of them: no tail pieces
        tail = not multi and n > 0 and (view.max_degree is None or view.max_degree > cut)
        opts = _launch.options(dtype, vec, view.indices.dtype, f"-DDP_CF={cf}",
                               f"-DDP_UNROLL={plan.unroll or ROWS_UNROLL[cf]}", *_checks.kernel_options())
        teams_per_block = ROWS_THREADS // dw
        prefix = (view.indptr, view.indices, view.edge_perm, np.int64(n), np.int32(chunks), np.int64(cut))
        call = (None,) * 6 + (np.int32(f), np.int32(dw))  # x, src_map, w, nbr_scale, row_scale, out; F, dw
        by_columns = np.int32(plan.sweep == "columns")
        self.slots, self.buffers = 0, {}
        if multi:
            if n >= 2**31:
                raise ValueError(f"rows_per_team > 1 takes graphs of fewer than 2**31 rows, not {n}")
            slots = -(-n // rows_per_team)
            edge_row = _edge_row(view)
            self.schedule = (edge_row,)
            self.head = _launch.PackedLaunch(
                _launch.function("spmm_rows.cu", "agg_rows_multi", opts), (-(-(slots * chunks) // teams_per_block),),
                ROWS_THREADS, prefix[:5] + (np.int32(rows_per_team), edge_row, by_columns) + call, range(8, 14))
            return
        order = _row_order(view) if plan.row_order == "degree" else None
        tail_blocks, long_args = 0, (None, None)
        if tail:
            long_slot, self.slots = _long_rows(view, cut, f * self.acc.itemsize)
            tail_blocks = -(-((view.num_edges // cut) * chunks) // teams_per_block)
            self.tail_pieces = tail_blocks * teams_per_block // chunks  # the pieces the tail blocks cover
            long_args = (_tail_cum(view, cut), long_slot)
        self.schedule = (order, cut) + long_args
        grid = tail_blocks + -(-(n * chunks) // teams_per_block)
        self.head = _launch.PackedLaunch(_launch.function("spmm_rows.cu", "agg_rows", opts), (grid,), ROWS_THREADS,
                                         prefix + (order, by_columns) + call + (np.int64(tail_blocks),)
                                         + long_args + (None, None), (*range(8, 14), 19, 20))

    def _long_buffers(self, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(part, count) of the current stream: zero when made, and left zero by every launch."""
        if not self.slots:
            return None, None
        h = _launch.current_stream(dev.index).ptr
        buf = self.buffers.get(h)
        if buf is None:
            if len(self.buffers) >= LONG_ROWS_STREAMS:  # the oldest stream's pair freed: the caching allocator
                self.buffers.pop(next(iter(self.buffers)))  # reuses it only on that stream, after its launches
            buf = self.buffers[h] = (torch.zeros((self.slots, self.feat), dtype=self.acc, device=dev),
                                     torch.zeros(self.slots * self.chunks, dtype=torch.int32, device=dev))
        return buf

    def validate(self, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
                 row_scale: torch.Tensor | None, src_map: torch.Tensor | None) -> None:
        """Debug mode: every value the launch reads is in bounds (synchronises; see `datapath.ops._checks`)."""
        indptr, indices, perm = self.csr
        _checks.validate_csr(indptr, indices, self.num_src, self.n, perm, "the row-split launch's CSR")
        e = indices.numel()
        if src_map is not None:
            _checks.validate_length(src_map, self.num_src, "src_map")
            _checks.validate_ids(src_map[: self.num_src], x.shape[0], "src_map")
        _checks.validate_length(w, e, "the edge weights")
        _checks.validate_length(nbr_scale, self.num_src, "the neighbour scale")
        _checks.validate_length(row_scale, self.n, "the row scale")
        if self.multi:
            (edge_row,) = self.schedule
            want = torch.repeat_interleave(torch.arange(self.n, device=indptr.device, dtype=torch.int32),
                                           indptr[1:] - indptr[:-1], output_size=e)
            if not torch.equal(edge_row, want):
                raise RuntimeError("the row-split launch's edge rows no longer match its CSR")
        elif self.slots:
            _order, cut, tail_cum, long_slot = self.schedule
            deg = indptr[1:] - indptr[:-1]
            pieces = int(tail_cum[-1]) if self.n else 0
            longs = int((deg > cut).sum())
            if pieces > self.tail_pieces or longs > self.slots or int(long_slot.max()) >= self.slots:
                raise RuntimeError(f"the row-split launch covers {self.tail_pieces} tail pieces and {self.slots} long "
                                   f"rows but its CSR has {pieces} and {longs}")

    def check(self, x: torch.Tensor, src_map: torch.Tensor | None) -> None:
        """Raise unless ``x`` is what the launch reads: (num_src, F) rows of its dtype, contiguous (a table of F-wide
        rows with ``src_map``, of at least num_src ids)."""
        if ((x.shape != self.in_shape if src_map is None else
             x.dim() != 2 or x.shape[1] != self.feat or src_map.numel() < self.num_src)
                or x.dtype != self.dtype or not x.is_contiguous()):
            raise _checks.rows_error(x, tuple(self.in_shape), self.dtype, "aggregation rows")

    def run(self, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
            row_scale: torch.Tensor | None, src_map: torch.Tensor | None, check: bool = True) -> torch.Tensor:
        """(rows, F) aggregation of ``x`` (see `check`; ``check=False`` only for rows a public op validated)."""
        if check:
            self.check(x, src_map)
        if _DEBUG[0]:
            self.validate(x, w, nbr_scale, row_scale, src_map)
        out = x.new_empty((self.n, x.shape[1]))
        if self.multi:
            self.head(x.get_device(), x, src_map, w, nbr_scale, row_scale, out)
        elif not self.slots:  # no long rows: no buffers
            self.head(x.get_device(), x, src_map, w, nbr_scale, row_scale, out, None, None)
        else:
            self.head(x.get_device(), x, src_map, w, nbr_scale, row_scale, out, *self._long_buffers(x.device))
        return out


ROWS_UNROLL = {1: 4, 2: 2, 4: 1}
"""Neighbours per unrolled step of a rows team, by column vectors per lane (4 vector loads in flight)."""


def rows(view: CSRView, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
         row_scale: torch.Tensor | None, plan: AggregationPlan, src_map: torch.Tensor | None = None) -> torch.Tensor:
    """The row-split kernel (``spmm_rows.cu``); its launch is prepared once per (view, dtype, width, plan)."""
    n, f = view.num_dst, x.shape[1]
    if n == 0 or f == 0:
        return torch.zeros(n, f, dtype=x.dtype, device=x.device)
    vec, dw, cf = plan.vec, plan.dw, plan.cf
    if x.data_ptr() % (vec * x.element_size()):  # a misaligned x: the widths the model would give for this vector
        vec = aligned_vec(vec, f, x.element_size(), x)
        nv = f // vec
        dw, cf = min(32, _next_pow2(nv)), (2 if nv > 32 else 1)
    return rows_launch(view, x.dtype, f, vec, dw, cf, plan).run(x, w, nbr_scale, row_scale, src_map)


def rows_launch(view: CSRView, dtype: torch.dtype, f: int, vec: int, dw: int, cf: int,
                plan: AggregationPlan) -> _RowsLaunch:
    """The row-split launch for this view and layout (compiled and kept with the view on first use)."""
    key = ("rows_launch", dtype, f, vec, dw, cf, plan.cut, plan.unroll, plan.row_order, plan.sweep,
           plan.rows_per_team, _checks.kernel_options())
    launch_ = view.cache.get(key)
    if launch_ is None:
        launch_ = view.cache[key] = _RowsLaunch(view, dtype, f, vec, dw, cf, plan)
    return launch_


TC_DTYPES = (torch.float16, torch.bfloat16)


def tensor_core_ok(dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernel takes ``dtype`` (float32 as tf32 only when matmuls may use tf32)."""
    return dtype in TC_DTYPES or (dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def translation(view: CSRView, dtype: torch.dtype) -> Translation:
    kb = 8 if dtype == torch.float32 else 16
    return view.cached(("sgt", kb), lambda: translate(view, kb))


def tensor_core(view: CSRView, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
                row_scale: torch.Tensor | None, plan: AggregationPlan) -> torch.Tensor:
    """The tensor-core kernel (``spmm_tc.cu``) over the graph's sparse graph translation."""
    n, f = view.num_dst, x.shape[1]
    if not tensor_core_ok(x.dtype):
        raise ValueError(f"the tensor-core kernel takes float16/bfloat16 (float32 with tf32 allowed), not {x.dtype}")
    if x.dim() != 2 or x.shape[0] != view.num_src or not x.is_contiguous():
        raise _checks.rows_error(x, (view.num_src, f), x.dtype, "tensor-core aggregation rows")
    if n == 0 or f == 0:
        return torch.zeros(n, f, dtype=x.dtype, device=x.device)
    sgt = translation(view, x.dtype)
    elem = x.element_size()
    vec = aligned_vec(widest_vec(f, elem), f, elem, x)
    nt = plan.nt
    nw = max(1, min(4, -(-f // (8 * nt))))
    ct = nw * nt * 8
    tiles = -(-f // ct)
    smem = sgt.kb * (ct + 16 // elem) * elem + 16 * sgt.kb * 4 + sgt.kb * 4
    out = torch.empty(n, f, dtype=x.dtype, device=x.device)
    opts = (f"-DDP_KIND={_launch.KIND[x.dtype]}", f"-DDP_VEC={vec}", f"-DDP_NT={nt}")
    fn = _launch.function("spmm_tc.cu", "spmm_tc", opts)
    launch(fn, (sgt.num_windows, tiles), nw * 32, (
        ptr(sgt.win_ptr), ptr(sgt.blk_col), ptr(sgt.blk_eptr), ptr(sgt.e_slot),
        ptr(sgt.e_id if w is not None else None), np.int64(n), ptr(x), ptr(w), ptr(nbr_scale),
        ptr(row_scale), ptr(out), np.int32(f)), x.device.index, shared_mem=smem)
    return out


def _csr_index(view: CSRView) -> tuple[torch.Tensor, torch.Tensor]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        small = view.num_edges < 2**31 - 1 and view.num_src < 2**31 - 1
        dt = torch.int32 if small else torch.int64
        return view.indptr.to(dt), view.indices.to(dt)
    return view.cached("cusparse_index", make)


def _values(view: CSRView, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
            row_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(E,) per-edge value of the matrix in ``dtype``: weight times both scales."""
    if w is not None:
        w = w.reshape(-1)
        v = w if view.edge_perm is None else w.index_select(0, view.edge_perm)
    else:
        v = torch.ones(view.num_edges, dtype=torch.float32 if dtype != torch.float64 else dtype, device=view.device)
    if nbr_scale is not None:
        v = v * nbr_scale.index_select(0, view.indices64())
    if row_scale is not None:
        v = v * row_scale.index_select(0, view.edge_dst())
    return v.to(dtype)


def _coalesced(view: CSRView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """(crow, col, slot, nnz) of ``view`` with its duplicate edges merged (``slot``: each edge's entry), or None
    where the view has no more edges than entries: cuSPARSE refuses a CSR of more stored values than rows times
    columns (``cusparseCreateCsr``: invalid value), which duplicate edges in a small graph give."""
    if view.num_edges <= view.num_dst * view.num_src:
        return None

    def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        key = view.edge_dst() * view.num_src + view.indices64()  # row-major: the CSR's order
        uniq, slot = torch.unique(key, sorted=True, return_inverse=True)  # one host synchronisation (the size)
        rows = torch.div(uniq, view.num_src, rounding_mode="floor")
        crow = torch.zeros(view.num_dst + 1, dtype=torch.int64, device=view.device)
        crow[1:] = torch.cumsum(torch.zeros(view.num_dst, dtype=torch.int64, device=view.device).index_add_(
            0, rows, torch.ones_like(rows)), 0)
        return crow.int(), (uniq - rows * view.num_src).int(), slot, int(uniq.numel())
    return view.cached("cusparse_coalesced", make)


def _matrix(view: CSRView, values: torch.Tensor) -> torch.Tensor:
    merged = _coalesced(view)
    if merged is not None:  # duplicate edges summed into one entry each (the same product)
        crow, col, slot, nnz = merged
        acc = torch.float64 if values.dtype == torch.float64 else torch.float32
        values = torch.zeros(nnz, dtype=acc, device=values.device).index_add_(0, slot, values.to(acc)).to(values.dtype)
        return torch.sparse_csr_tensor(crow, col, values, (view.num_dst, view.num_src), check_invariants=False)
    crow, col = _csr_index(view)
    return torch.sparse_csr_tensor(crow, col, values, (view.num_dst, view.num_src), check_invariants=False)


def matrix(view: CSRView, dtype: torch.dtype, nbr_scale: torch.Tensor | None,
           row_scale: torch.Tensor | None) -> torch.Tensor:
    """The unweighted view with both scales as a ``dtype`` CSR matrix (built once, kept with the view)."""
    key = ("cusparse_matrix", dtype, Ref(nbr_scale), Ref(row_scale))  # the scales themselves, not their ids
    mat = view.cache.get(key)
    if mat is None:
        mat = view.cache[key] = _matrix(view, _values(view, None, nbr_scale, row_scale, dtype))
    return mat


def cusparse(view: CSRView, x: torch.Tensor, w: torch.Tensor | None, nbr_scale: torch.Tensor | None,
             row_scale: torch.Tensor | None) -> torch.Tensor:
    """``torch.sparse.mm`` with the view as a CSR matrix (cuSPARSE SpMM); the matrix is kept when unweighted."""
    if w is None:
        return torch.sparse.mm(matrix(view, x.dtype, nbr_scale, row_scale), x)
    return torch.sparse.mm(_matrix(view, _values(view, w, nbr_scale, row_scale, x.dtype)), x)


def view_ref(view: CSRView, strong: bool) -> Callable[[], CSRView]:
    """``get()`` giving ``view`` back: holding it (``strong``: a runner kept anywhere but in the view's own cache,
    e.g. a transposed view's runner kept with the forward's view, or by an autograd node) or weakly (a runner kept
    in the view's own cache: no reference cycle; it is only called by a caller holding the view)."""
    if strong:
        return lambda: view
    ref = weakref.ref(view)

    def get() -> CSRView:
        v = ref()
        if v is None:  # a weak runner called without its view: a bug of the caller, never a read of freed memory
            raise RuntimeError("an aggregation runner was called after its graph's view was freed; keep the graph "
                               "(or the runner's owner) alive while the runner may be called")
        return v
    return get


def bound(view: CSRView, plan: AggregationPlan, feat: int, dtype: torch.dtype, nbr_scale: torch.Tensor | None,
          row_scale: torch.Tensor | None, strong: bool = False,
          check: bool = True) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``run(x)``: the unweighted aggregation of contiguous (view.num_src, feat) ``dtype`` rows by ``plan``'s
    kernel (``rows`` or ``cusparse``; None for the others), everything but the call resolved here (the launch,
    the matrix): the least host work per call.  The launch and the matrix hold what they read; ``strong``: the
    runner holds the view too (see `view_ref`); ``check``: the runner checks each x's shape, dtype and layout
    (False only for a runner called with rows its public op validated: the forward of `aggregate`)."""
    if plan.kernel == "rows" and view.num_dst > 0:
        launch_ = rows_launch(view, dtype, feat, plan.vec, plan.dw, plan.cf, plan)
        align = plan.vec * dtype.itemsize
        get = view_ref(view, strong)

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.data_ptr() % align:
                return rows(get(), x, None, nbr_scale, row_scale, plan)
            return launch_.run(x, None, nbr_scale, row_scale, None, check)
        return run
    if plan.kernel == "cusparse":
        mat = matrix(view, dtype, nbr_scale, row_scale)
        if not check:
            return lambda x: torch.sparse.mm(mat, x)
        shape = torch.Size((view.num_src, feat))

        def run_library(x: torch.Tensor) -> torch.Tensor:
            if x.shape != shape or x.dtype != dtype:
                raise _checks.rows_error(x, tuple(shape), dtype, "aggregation rows")
            return torch.sparse.mm(mat, x)
        return run_library
    return None
