"""One copy of a dataset in shared host memory for every process of a machine.

Rank 0 builds or loads the dataset and writes each array once into shared host memory
(`datapath.unified_tensor.share`: a file in ``/dev/shm``); after a broadcast of the
table names the other ranks `~datapath.unified_tensor.attach` the same pages and pin
them for their own GPU.  No rank holds a private copy.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from datapath._runtime import settings
from datapath._runtime.reaper import Reaper
from datapath.apps.errors import DistributedError
from datapath.apps.launch import PREFIX_ENV, DistContext, new_prefix
from datapath.graph import Dataset, Graph
from datapath.memory import host_of
from datapath.unified_tensor import attach, share, shared_tables, shm_dir, unlink

log = logging.getLogger("datapath.apps.shared_data")


@dataclass
class SharedDataset(Dataset):
    """A `Dataset` whose arrays are views of shared tables (one copy for all processes of the machine).

    The arrays are plain CPU tensors over the shared pages, pinned for this process's
    GPU while ``tables`` (the unified tensors holding the registrations) is alive.
    """

    tables: dict[str, Any] = field(default_factory=dict, repr=False)
    prefix: str = ""


def share_dataset(ds: Dataset, prefix: str) -> tuple[dict[str, Any], SharedDataset]:
    """Copy every array of ``ds`` once into shared memory, as tables ``<prefix>.<array>``.

    Returns the descriptor other processes pass to `attach_dataset` (small, picklable)
    and this process's `SharedDataset` over the shared copy.  Drop ``ds`` afterwards.
    The tables go when this process ends, however it ends: at exit, or -- killed (SIGKILL, the
    OOM killer) -- by a `datapath._runtime.reaper.Reaper` watching it; the other processes'
    mappings stay valid until they unmap them.
    """
    Reaper([str(shm_dir() / f"datapath-{prefix}.*")])  # before the first table: a kill mid-way leaves none
    arrays = {"indptr": ds.graph.indptr, "indices": ds.graph.indices, "edge_ids": ds.graph.edge_ids,
              "features": ds.features, "labels": ds.labels, "train_idx": ds.train_idx, "val_idx": ds.val_idx,
              "test_idx": ds.test_idx}
    tables = {}
    try:
        for k, t in arrays.items():
            if t is not None:
                tables[k] = share(host_of(t) if t.device.type != "cuda" else t, f"{prefix}.{k}")
    except BaseException:
        for k in tables:
            unlink(f"{prefix}.{k}")
        raise
    desc = {"prefix": prefix, "name": ds.name, "num_classes": ds.num_classes, "meta": ds.meta,
            "num_src_nodes": ds.graph.num_src_nodes, "arrays": sorted(tables)}
    return desc, _wrap(desc, tables)


def attach_dataset(desc: dict[str, Any]) -> SharedDataset:
    """This process's view of the dataset shared by `share_dataset` (maps and pins, copies nothing)."""
    tables = {k: attach(f"{desc['prefix']}.{k}") for k in desc["arrays"]}
    return _wrap(desc, tables)


def _wrap(desc: dict[str, Any], tables: dict[str, Any]) -> SharedDataset:
    h = {k: host_of(u) for k, u in tables.items()}
    graph = Graph(h["indptr"], h["indices"], edge_ids=h.get("edge_ids"), num_src_nodes=desc["num_src_nodes"],
                  validate=False)
    return SharedDataset(desc["name"], graph, h["features"], h["labels"], h["train_idx"], h["val_idx"],
                         h["test_idx"], desc["num_classes"], dict(desc["meta"]), tables=tables,
                         prefix=desc["prefix"])


def shared_dataset(ctx: DistContext, make: Callable[[], Dataset], prefix: str | None = None) -> SharedDataset:
    """Rank 0 calls ``make()`` and shares the result; every rank returns its view of the one shared copy.

    ``prefix`` (rank 0 only; default ``$DATAPATH_SHARE_PREFIX`` or a fresh one) names the tables.
    """
    desc = None
    err = None
    failure: Exception | None = None
    if ctx.is_main:
        try:
            ds = make()
            desc, shared = share_dataset(ds, prefix or settings.get(PREFIX_ENV) or new_prefix())
            del ds
            gc.collect()
        except Exception as exc:  # noqa: BLE001 - told to every rank; rank 0 raises the original
            err = f"{type(exc).__name__}: {exc}"
            failure = exc
            if ctx.world_size == 1:
                raise
            log.debug("rank 0 could not build and share the dataset:\n%s", traceback.format_exc())
    if ctx.world_size > 1:
        box = [(desc, err)]
        dist.broadcast_object_list(box, src=0)
        desc, err = box[0]
        if failure is not None:
            raise failure
        if err is not None:
            raise DistributedError(f"rank 0 could not build and share the dataset: {err}")
        if not ctx.is_main:
            shared = attach_dataset(desc)
        ctx.barrier()
    mapped = _smaps_of(_table_pattern(shared.prefix))["mappings"]
    if mapped < len(shared.tables):
        log.warning("rank %d holds a private copy of %d of the %d shared tables: %s is not RAM-backed, and Linux "
                    "does not let a GPU pin a disk file's pages in place. Point DATAPATH_SHM_DIR at a tmpfs "
                    "(/dev/shm; docker --shm-size) to keep one copy.", ctx.rank, len(shared.tables) - mapped,
                    len(shared.tables), shm_dir())
    return shared


# -- host memory -------------------------------------------------------------------------------
def _smaps_of(pattern: re.Pattern[str]) -> dict[str, int]:
    """Rss and Pss (bytes) of this process's mappings whose path matches ``pattern`` (Linux)."""
    out = {"rss": 0, "pss": 0, "size": 0, "mappings": 0}
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return out
    match = False
    for line in text.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            match = len(head) == 6 and bool(pattern.search(head[5]))
            out["mappings"] += match
            continue
        if match and head and head[0] in ("Rss:", "Pss:", "Size:"):
            out[head[0][:-1].lower()] += int(head[1]) * 1024
    return out


def _table_pattern(prefix: str) -> re.Pattern[str]:
    """Matches the paths of the job's shared-table files (as /proc/self/smaps shows them)."""
    return re.compile(re.escape(os.path.join(os.path.realpath(shm_dir()), f"datapath-{prefix}.")))


def segment_bytes(prefix: str) -> dict[str, int]:
    """Size of the job's shared tables: ``nbytes`` (data) and ``allocated`` (blocks the files hold)."""
    nbytes = allocated = count = 0
    for name, info in shared_tables().items():
        if name.startswith(prefix + "."):
            count += 1
            nbytes += int(info.get("nbytes", 0))
            try:
                allocated += os.stat(shm_dir() / f"datapath-{name}.bin").st_blocks * 512
            except OSError:
                pass
    return {"tables": count, "nbytes": nbytes, "allocated": allocated}


def memory_footprint(prefix: str | None = None) -> dict[str, Any]:
    """This process's host memory (psutil ``memory_full_info``: rss, uss, pss, shared; bytes).

    With ``prefix``, also the resident (``shared_rss``) and proportional (``shared_pss``)
    bytes of its mappings of the job's shared tables, and the segment's size.
    """
    info = psutil.Process().memory_full_info()
    out: dict[str, Any] = {k: int(getattr(info, k)) for k in ("rss", "uss", "pss", "shared") if hasattr(info, k)}
    if prefix:
        m = _smaps_of(_table_pattern(prefix))
        out.update(shared_rss=m["rss"], shared_pss=m["pss"], shared_mapped=m["size"], shared_mappings=m["mappings"],
                   segment=segment_bytes(prefix))
    return out
