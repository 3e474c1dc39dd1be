"""The distributed tier of a `FeatureStore`: the table's rows cut into shards over the ranks of a job.

    from datapath.graph import ShardLayout
    layout = ShardLayout.even(num_rows, world_size)              # rank r holds rows layout.rows(r)
    feats = sharded_store(my_rows, layout, gpu_cache="10%", hotness=hot)   # every rank calls it
    x = feats[cuda_idx]    # GPU cache hits, own rows zero copy from pinned host memory, and the other
                           # ranks' rows fetched from them: one all_to_all of ids, one of rows

Each rank keeps its shard in pinned host memory (read zero copy by its GPU) and serves the other
ranks' requests from it; its GPU cache holds the hottest rows of any shard (the remote ones are
fetched once, when the store is built) or of its own (``cache_scope``).  The other ranks' rows come
through `ShardedTier` (`datapath.features.exchange`: one exchange per gather, one host
synchronisation).  Only the features are sharded: every rank holds the whole graph.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from datapath.features.budget import format_bytes, parse_budget
from datapath.features.errors import FeatureStoreError
from datapath.features.exchange import DEFAULT_TIMEOUT_S, PIECE_BYTES, ShardedTier, new_exchange_group
from datapath.features.hotness import degree_hotness, rank as rank_rows
from datapath.features.store import FeatureStore
from datapath.graph import Graph, ShardLayout
from datapath.memory import pinned_empty

__all__ = ["CACHE_SCOPES", "DEFAULT_TIMEOUT_S", "PIECE_BYTES", "ShardedTier", "new_exchange_group", "sharded_store"]

log = logging.getLogger("datapath.features.sharded")


def _cache_rows(gpu_cache: str | float | int | None, n: int, row_bytes: int) -> int:
    """Rows of a GPU cache of ``gpu_cache`` (a budget over the whole table's bytes)."""
    cache_bytes = parse_budget(gpu_cache, n * row_bytes, "gpu_cache") or 0
    if cache_bytes > n * row_bytes:
        raise FeatureStoreError(f"gpu_cache={gpu_cache!r} ({format_bytes(cache_bytes)}) is larger than the table "
                                f"({format_bytes(n * row_bytes)}); give at most '100%'")
    return min(n, cache_bytes // row_bytes) if row_bytes else 0


def _check_agreement(shard: torch.Tensor, layout: ShardLayout, rank: int, group: Any,
                     problem: str | None = None) -> None:
    """Every rank checks its shard (and reports ``problem``); each raises naming the first rank that failed."""
    lo, hi = layout.rows(rank)
    if problem is None and (shard.dim() < 1 or shard.shape[0] != hi - lo):
        problem = (f"its shard has shape {tuple(shard.shape)} but rank {rank} of a {layout.num_rows}-row table cut "
                   f"{list(layout.bounds)} holds rows {lo}..{hi - 1} ({hi - lo} rows)")
    facts = (problem, tuple(shard.shape[1:]), str(shard.dtype))
    every: list[Any] = [None] * layout.shards
    dist.all_gather_object(every, facts, group=group)
    for r, (p, _, _) in enumerate(every):
        if p is not None:
            raise FeatureStoreError(f"rank {r}: {p}" if r == rank else
                                    f"rank {rank} stops: rank {r} was given a bad shard or argument: {p}")
    for r, (_, rest, dtype) in enumerate(every):
        if (rest, dtype) != every[0][1:]:
            raise FeatureStoreError(f"the ranks' shards differ: rank 0 holds {every[0][2]} rows of shape "
                                    f"{every[0][1]}, rank {r} {dtype} rows of shape {rest}; every shard must come "
                                    f"from the same table")


CACHE_SCOPES = ("any", "own")


def sharded_store(shard: torch.Tensor, layout: ShardLayout, *, gpu_cache: str | float | int | None = None,
                  hotness: torch.Tensor | Graph | None = None, cache_scope: str = "any",
                  device: str | torch.device | None = None, group: Any = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, piece_bytes: int = PIECE_BYTES) -> FeatureStore:
    """A `FeatureStore` of a table whose rows are cut over the ranks: this rank holds ``shard``.

    Collective: every rank of the job calls it (the default process group must be initialised,
    with ``layout.shards`` ranks; in a one-rank job it is a plain store of ``shard``).

    Args:
        shard: (n, *rest) this rank's rows ``layout.rows(rank)``, any host memory (e.g. the memory map
            `datapath.graph.load_dataset` returns with ``shard=``); copied once into pinned host memory
            (host memory without CUDA).
        layout: the cut of the table (`datapath.graph.ShardLayout`).
        gpu_cache: GPU memory for hot rows (``"25%"`` of the whole table's bytes, ``"4GB"``, ...).
        hotness: (N,) scores over the whole table (`presample_hotness`), or the `Graph` (degrees).
        cache_scope: which hot rows the cache holds: ``"any"``, the hottest of any shard (the other
            ranks' are fetched from them once, here; a hit saves the network and the owner's PCIe
            read: best when the network is slower than PCIe), or ``"own"``, the hottest of this rank's
            shard (the other ranks' requests for them are served from this GPU: best when the network
            is faster than PCIe, e.g. GPUs linked by NVLink).  The other ranks' requests are always
            served from this rank's cache where it holds the row.
        device: where batches go (default: the current CUDA device, else the CPU).
        group: the exchange's process group (default: a new one, `new_exchange_group`).
        timeout_s: how long an exchange waits for the other ranks before it fails.
        piece_bytes: see `ShardedTier` (the same on every rank).
    """
    if not dist.is_available() or not dist.is_initialized():
        if layout.shards != 1:
            raise FeatureStoreError(f"a table cut into {layout.shards} shards needs a torch.distributed job of "
                                    f"{layout.shards} ranks (init_process_group; e.g. under torchrun)")
        return FeatureStore(_host_copy(shard, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))),
                            gpu_cache=gpu_cache, hotness=hotness, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout.shards != world:
        raise FeatureStoreError(f"the table is cut into {layout.shards} shards but the job has {world} ranks; "
                                f"give one shard per rank")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    group = group if group is not None else new_exchange_group(timeout_s)
    n = layout.num_rows
    row_bytes = math.prod(shard.shape[1:]) * shard.element_size()
    try:  # every rank learns of a bad argument of any rank before the first exchange
        if cache_scope not in CACHE_SCOPES:
            raise FeatureStoreError(f"cache_scope must be one of {CACHE_SCOPES}, got {cache_scope!r}")
        own = layout.rows(rank) if cache_scope == "own" else None
        cache_ids = _hottest(hotness, n, _cache_rows(gpu_cache, n, row_bytes), own)
        problem = None
    except FeatureStoreError as exc:
        cache_ids, problem = torch.zeros(0, dtype=torch.int64), str(exc)
    _check_agreement(shard, layout, rank, group, problem)
    lo, hi = layout.rows(rank)
    rest = tuple(shard.shape[1:])
    host = _host_copy(shard, device)
    tier = ShardedTier(host, layout, rank, group, device, piece_bytes)
    c = int(cache_ids.numel())
    remote = cache_ids[(cache_ids < lo) | (cache_ids >= hi)]
    fetched = tier.exchange(remote)  # every rank, also with nothing to fetch: the exchange is collective
    cache = None
    if c:
        cache = torch.empty((c, *rest), dtype=shard.dtype, device=device)
        is_local = (cache_ids >= lo) & (cache_ids < hi)
        pos_local, pos_remote = is_local.nonzero().squeeze(1), (~is_local).nonzero().squeeze(1)
        cache[pos_local.to(device)] = host[cache_ids[pos_local] - lo].to(device)
        cache[pos_remote.to(device)] = fetched
    slots = torch.full((n,), -1, dtype=torch.int32, device=device)
    slots[lo:hi] = torch.arange(c + 1, c + 1 + hi - lo, dtype=torch.int32, device=device)
    if c:
        slots[cache_ids.to(device)] = torch.arange(1, c + 1, dtype=torch.int32, device=device)
    tier.rows -= int(remote.numel())
    tier.attach(cache, slots)
    if c:
        tier.mark_remote_cache((cache_ids < lo) | (cache_ids >= hi))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    tier.stats.reset()  # the statistics count the batches, not the cache's filling
    return FeatureStore.from_tiers((n, *rest), shard.dtype, cache=cache, host=host, slots=slots, fetch=[tier],
                                   device=device)


def _host_copy(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``shard``'s rows copied into pinned host memory (for a CUDA ``device``) or CPU memory."""
    host = pinned_empty(tuple(shard.shape), shard.dtype) if device.type == "cuda" else \
        torch.empty(tuple(shard.shape), dtype=shard.dtype)
    return host.copy_(shard)


def _hottest(hotness: torch.Tensor | Graph | None, n: int, c: int,
             within: tuple[int, int] | None = None) -> torch.Tensor:
    """(c,) int64 ids of the ``c`` hottest rows (CPU), of rows ``within[0]:within[1]`` only if given."""
    lo, hi = within if within is not None else (0, n)
    c = min(c, hi - lo)
    if c == 0:
        return torch.zeros(0, dtype=torch.int64)
    if hotness is None:
        log.warning("no hotness given: the GPU cache holds the first rows; pass hotness= "
                    "(datapath.features.presample_hotness(...) or the graph) to cache the hot ones")
        return torch.arange(lo, lo + c)
    scores = degree_hotness(hotness) if isinstance(hotness, Graph) else torch.as_tensor(hotness)
    if scores.shape != (n,):
        raise FeatureStoreError(f"hotness must hold one score per row of the whole table ({n},), got "
                                f"{tuple(scores.shape)}")
    return rank_rows(scores[lo:hi])[:c].cpu() + lo
