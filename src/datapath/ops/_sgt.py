"""TC-GNN's sparse graph translation: the tiles the tensor-core kernel multiplies (see ``spmm_tc.cu``).

Rows are cut into windows of 16; the distinct source columns of a window, in ascending
order, are condensed into blocks of ``kb`` columns (16 for half/bfloat16, 8 for tf32), and
every edge is given its block and its slot ``(row % 16) * kb + column`` in the block's tile.
Built once per graph with torch ops on the graph's device (one synchronisation, for the
number of blocks); kept in the graph's view.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from datapath.ops._graph import CSRView

WINDOW = 16


@dataclass(eq=False)
class Translation:
    """The translated graph: see ``spmm_tc.cu`` for the layout of each array."""

    kb: int
    num_windows: int
    num_blocks: int
    win_ptr: torch.Tensor   # (num_windows+1,) int64
    blk_col: torch.Tensor   # (num_blocks, kb) int32, -1 = padding
    blk_eptr: torch.Tensor  # (num_blocks+1,) int64
    e_slot: torch.Tensor    # (E,) uint8
    e_id: torch.Tensor      # (E,) int64: original CSR position of each block-sorted edge

    def tensors(self) -> list[torch.Tensor]:
        return [self.win_ptr, self.blk_col, self.blk_eptr, self.e_slot, self.e_id]

    @property
    def density(self) -> float:
        """Edges per tile slot: how full the tensor-core tiles are (1.0 = dense)."""
        return self.e_slot.numel() / max(1, self.num_blocks * WINDOW * self.kb)


def translate(view: CSRView, kb: int) -> Translation:
    """The sparse graph translation of ``view`` for tiles of 16 rows by ``kb`` columns."""
    dev = view.device
    n, ns = view.num_dst, view.num_src
    nwin = -(-n // WINDOW)
    rows = view.edge_dst()
    cols = view.indices64()
    win = torch.div(rows, WINDOW, rounding_mode="floor")
    key = win * ns + cols
    uniq, inv = torch.unique(key, sorted=True, return_inverse=True)  # one synchronisation (sizes)
    u_win = torch.div(uniq, ns, rounding_mode="floor")
    u_col = uniq - u_win * ns
    cnt = torch.zeros(nwin, dtype=torch.int64, device=dev).index_add_(
        0, u_win, torch.ones_like(u_win))
    first = torch.cumsum(cnt, 0) - cnt  # first unique column of each window
    pos = torch.arange(uniq.numel(), device=dev) - first.index_select(0, u_win)
    nblk = torch.div(cnt + (kb - 1), kb, rounding_mode="floor")
    win_ptr = torch.zeros(nwin + 1, dtype=torch.int64, device=dev)
    torch.cumsum(nblk, 0, out=win_ptr[1:])
    num_blocks = int(win_ptr[-1]) if nwin else 0
    u_blk = win_ptr[:-1].index_select(0, u_win) + torch.div(pos, kb, rounding_mode="floor")
    u_k = pos % kb
    blk_col = torch.full((num_blocks, kb), -1, dtype=torch.int32, device=dev)
    blk_col[u_blk, u_k] = u_col.to(torch.int32)
    e_blk = u_blk.index_select(0, inv)
    e_slot = (rows % WINDOW) * kb + u_k.index_select(0, inv)
    order = torch.sort(e_blk, stable=True).indices
    counts = torch.zeros(num_blocks, dtype=torch.int64, device=dev).index_add_(
        0, e_blk, torch.ones_like(e_blk))
    blk_eptr = torch.zeros(num_blocks + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=blk_eptr[1:])
    e_id = order if view.edge_perm is None else view.edge_perm.index_select(0, order)
    return Translation(kb, nwin, num_blocks, win_ptr, blk_col.contiguous(), blk_eptr,
                       e_slot.index_select(0, order).to(torch.uint8), e_id)
