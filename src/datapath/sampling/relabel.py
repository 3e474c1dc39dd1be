"""Deduplicate node ids and relabel them in first-occurrence order, without host syncs.

Used by the CPU and GPU paths of `NeighborSampler` (CPU and GPU give identical results).  Sizes stay on the
device, so a whole multi-layer sample runs without waiting for the GPU.
"""
from __future__ import annotations

import numpy as np
import torch

_SENTINEL = torch.iinfo(torch.int64).max


def relabel(keys: torch.Tensor, valid: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local ids of ``keys`` in order of first occurrence.

    Args:
        keys: (L,) int64 global node ids.
        valid: optional (L,) bool; invalid entries are ignored (their local id is undefined).

    Returns:
        ``(local, unique, count)``: ``local`` (L,) int64 with ``unique[local[p]] == keys[p]``;
        ``unique`` (L,) int64 whose first ``count`` entries are the distinct valid keys in
        order of first occurrence; ``count`` a (1,) int64 tensor. All on ``keys``' device.
    """
    n = keys.numel()
    dev = keys.device
    k = keys if valid is None else torch.where(valid, keys, _SENTINEL)
    sorted_keys, order = torch.sort(k, stable=True)
    head = torch.ones(n, dtype=torch.bool, device=dev)
    if n > 1:
        torch.ne(sorted_keys[1:], sorted_keys[:-1], out=head[1:])
    if valid is not None:
        head &= sorted_keys != _SENTINEL
    run = torch.cumsum(head, 0) - 1  # run id of each sorted element (a stable sort puts the first first)
    dummy = n
    run_first = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    run_first.scatter_(0, torch.where(head, run, dummy), order)  # position of each run's first element
    is_first = torch.empty(n, dtype=torch.bool, device=dev)
    is_first[order] = head
    new_id = torch.cumsum(is_first, 0) - 1  # at original positions
    local_sorted = new_id[run_first[run.clamp(min=0)]]
    local = torch.empty(n, dtype=torch.int64, device=dev)
    local[order] = local_sorted
    unique = torch.empty(n + 1, dtype=torch.int64, device=dev)
    unique.scatter_(0, torch.where(is_first, new_id, dummy), keys)
    count = new_id[-1:] + 1 if n else torch.zeros(1, dtype=torch.int64, device=dev)
    return local, unique[:n], count


def relabel_dense(keys: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CPU twin of `relabel` in O(L) with a dense per-node scratch array (same first-occurrence order).

    Args:
        keys: (L,) int64 node ids in ``[0, len(scratch))``.
        scratch: (num_nodes,) int64 filled with -1; left filled with -1 on return.

    Returns:
        ``(local, unique)``: (L,) int64 local ids and (U,) int64 distinct keys in first-occurrence order.
    """
    n = keys.size
    positions = np.arange(n, dtype=np.int64)
    scratch[keys[::-1]] = positions[::-1]  # repeated ids: the last assignment (the first occurrence) wins
    first = scratch[keys]
    scratch[keys] = -1
    is_first = first == positions
    new_id = np.cumsum(is_first, dtype=np.int64) - 1
    return new_id[first], keys[is_first]
