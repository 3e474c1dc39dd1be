"""Activation offloading in data-parallel jobs (DDP, FSDP): each rank offloads into its own directory.

    model = DistributedDataParallel(net)        # or fully_shard(net) (FSDP2), FullyShardedDataParallel(net)
    with offload_rank(model, target="ssd", path="/nvme/act") as cache:   # files in /nvme/act/rank<r>/
        loss = loss_fn(model(x)); loss.backward()

- Rank ``r`` (``torch.distributed.get_rank()``, else ``$RANK``) writes under
  ``path/rank<r>``, in a private directory of its process (mode 0700) that is removed
  when the cache closes and at exit.
- A rank that died (SIGKILL, out of memory, a node failure) cannot clean up: when the
  job restarts, every rank removes the directories that dead processes of this host
  left under *any* ``path/rank*`` (the job may restart with fewer ranks).
- The host budget of ``target="host"``/``"tiered"`` is split between the processes of
  the machine (``$LOCAL_WORLD_SIZE``): each rank pins its share, not 80% of the RAM.
- DDP and FSDP wrappers work as they are: the scope hooks go on the wrapper, the
  parameters it holds (FSDP2's DTensor shards, FSDP's flat parameters and the
  unsharded views made during forward) are never offloaded, and gradients are
  bit-identical to a run without offloading.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from datapath._runtime import pin_limit_bytes
from datapath.offload.spill_dir import clean_stale
from datapath.offload.cache import TensorCache
from datapath.offload.context import offload
from datapath.offload.errors import OffloadConfigError

log = logging.getLogger("datapath.offload.distributed")


def current_rank() -> int:
    """This process's rank: the default process group's, else ``$RANK``, else 0."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError as exc:
        raise OffloadConfigError(f"RANK={os.environ['RANK']!r} is not an integer") from exc


def local_world_size() -> int:
    """Processes of this job on this machine: ``$LOCAL_WORLD_SIZE``, else the world size, else 1."""
    import torch.distributed as dist  # noqa: PLC0415

    v = os.environ.get("LOCAL_WORLD_SIZE")
    if v:
        return max(1, int(v))
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank_path(path: str | os.PathLike[str], rank: int | None = None) -> Path:
    """``path/rank<rank>``: where rank ``rank`` (default: this one) offloads."""
    return Path(path).expanduser() / f"rank{current_rank() if rank is None else int(rank)}"


def clean_stale_ranks(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the offload directories that dead processes of this host left under every ``path/rank*``."""
    base = Path(path).expanduser()
    removed: list[Path] = []
    try:
        dirs = sorted(d for d in base.glob("rank*") if d.is_dir() and not d.is_symlink())
    except OSError:
        return removed
    for d in dirs:
        removed += clean_stale(d)
    return removed


@contextlib.contextmanager
def offload_rank(model: nn.Module | None = None, target: str = "host", path: str | os.PathLike[str] | None = None,
                 *, rank: int | None = None, host_budget_bytes: int | None = None,
                 **options: Any) -> Iterator[TensorCache]:
    """`datapath.offload.offload` for one rank of a data-parallel job (see the module docstring).

    ``model``: the wrapped model (DDP, FSDP, FSDP2) or the plain one.  ``path`` is
    the job's offload directory: this rank writes under ``path/rank<rank>``.
    ``host_budget_bytes`` defaults to this rank's share of what the machine can pin.
    Other options are `offload`'s.
    """
    r = current_rank() if rank is None else int(rank)
    sub = None
    if path is not None:
        removed = clean_stale_ranks(path)
        if removed:
            log.info("rank %d removed %d offload directories left by dead processes under %s", r, len(removed), path)
        sub = rank_path(path, r)
    if host_budget_bytes is None and target in ("host", "tiered"):
        share = 0.8 if target == "host" else 0.5
        host_budget_bytes = int(pin_limit_bytes() * share / local_world_size())
    with offload(model, target=target, path=None if sub is None else str(sub), host_budget_bytes=host_budget_bytes,
                 **options) as cache:
        yield cache
