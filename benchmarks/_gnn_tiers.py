"""B2's feature-store ways (`benchmarks/gnn_epoch.py`): the GPU cache, and host memory plus disk.

- ``datapath_cache``: a `FeatureStore` over the pinned table with a GPU cache of the hottest rows
  (``--gpu-cache-frac`` of the feature bytes, ranked by presampling the run's sampler), the graph
  on the GPU when it fits;
- ``datapath_disk``: the table written to a ``.npy`` file, a store with the same GPU cache and
  ``--host-memory-frac`` of the feature bytes in pinned host memory; the rest is read from the
  file (O_DIRECT).  The disk's random-read bandwidth is probed in the same run (4 KiB reads,
  many in flight), and the rows the store returns are compared with the table's.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath.features import DiskReader, FeatureStore, ReadPlan, TableFile, presample_hotness
from datapath.loaders import NeighborLoader
from datapath.memory import gather_rows, host_of
from datapath.sampling import NeighborSampler
from datapath.unified_tensor import as_unified

_log = logging.getLogger("datapath.bench.gnn_tiers")


def hotness(graph: Any, ds: Any, args: Any) -> torch.Tensor:
    """Presampled hotness (GNNLab) with the benchmark's sampler shape."""
    fanouts = [int(f) for f in args.fanouts.split(",")]
    return presample_hotness(graph, ds.train_idx, NeighborSampler(fanouts, seed=args.seed),
                             batch_size=args.batch_size, batches=args.presample_batches, seed=args.seed)


def cache_store(features: torch.Tensor, hot: torch.Tensor, frac: float) -> FeatureStore:
    """A store over the pinned table (its host tier) with a GPU cache of ``frac`` of the feature bytes."""
    return FeatureStore(features, gpu_cache=frac, hotness=hot)


def write_table(features: torch.Tensor, path: Path) -> dict[str, Any]:
    """Write the (N, F) host table as a ``.npy`` file (as prepare-dataset does) and fsync it."""
    arr = host_of(features).numpy()
    need = arr.nbytes + (1 << 30)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise OSError(f"{path.parent} has {free / 2**30:.1f} GiB free; the table needs {need / 2**30:.1f} GiB")
    t0 = time.perf_counter()
    flat = arr.reshape(-1).view(np.uint8)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        step = 256 << 20
        for lo in range(0, flat.size, step):
            f.write(memoryview(flat[lo:lo + step]))
        f.flush()
        os.fsync(f.fileno())
    return {"path": str(path), "bytes": os.path.getsize(path), "write_s": time.perf_counter() - t0}


def probe_disk(path: Path, reads: int = 60_000, depths: tuple[int, ...] = (64, 256, 1024)) -> dict[str, Any]:
    """Random 4 KiB O_DIRECT reads of ``path``, ``depth`` in flight (fio libaio randread bs=4k iodepth=depth)."""
    tf = TableFile.open(path)
    pages = os.path.getsize(path) // 4096
    rng = np.random.default_rng(0)
    staging = torch.empty(reads * 4096 + 4096, dtype=torch.uint8)
    staging = staging[(-staging.data_ptr()) % 4096:]
    out: dict[str, Any] = {"read_bytes": 4096, "reads": reads, "by_depth": {}}
    for depth in depths:
        reader = DiskReader(tf, "aio", depth=depth)
        offs = rng.integers(0, pages, reads).astype(np.int64) * 4096
        lengths = np.full(reads, 4096, np.int64)
        plan = ReadPlan(offs, lengths, np.arange(reads, dtype=np.int64) * 4096, np.zeros(0, np.int64))
        t0 = time.perf_counter()
        reader.read(plan, staging)
        dt = time.perf_counter() - t0
        reader.close()
        out["by_depth"][depth] = {"GBps": reads * 4096 / dt / 1e9, "iops": reads / dt}
        out["engine"], out["direct"] = reader.engine, reader.direct
    out["GBps"] = max(v["GBps"] for v in out["by_depth"].values())
    return out


def disk_store(path: Path, hot: torch.Tensor, cache_frac: float, host_frac: float) -> tuple[FeatureStore, float]:
    t0 = time.perf_counter()
    fs = FeatureStore(path, gpu_cache=cache_frac, host_memory=host_frac, hotness=hot)
    return fs, time.perf_counter() - t0


def verify_rows(graph: Any, ds: Any, store: FeatureStore, reference: torch.Tensor, args: Any,
                batches: int) -> dict[str, Any]:
    """Gather ``batches`` loader batches through ``store`` and through the in-memory ``reference``: equal bits?"""
    fanouts = [int(f) for f in args.fanouts.split(",")]
    loader = NeighborLoader(graph, ds.train_idx, NeighborSampler(fanouts, seed=args.seed + 5), args.batch_size,
                            shuffle=True, features=store, seed=args.seed + 5, prefetch=1)
    equal, rows, sum_store, sum_ref = True, 0, 0.0, 0.0
    it = iter(loader)
    try:
        for _ in range(min(batches, len(loader))):
            b = next(it)
            ref = gather_rows(reference, b.input_nodes, sync=True)
            equal &= bool(torch.equal(b.x.view(torch.int32), ref.view(torch.int32)))
            rows += b.x.shape[0]
            sum_store += float(b.x.double().sum())
            sum_ref += float(ref.double().sum())
    finally:
        it.close()
    return {"rows_match": equal and sum_store == sum_ref, "rows_checked": rows, "batches_checked": batches,
            "checksum_store": sum_store, "checksum_table": sum_ref}


def record(dataset: str, row: dict[str, Any], resident: dict[str, Any] | None, device: str, **extra: Any
           ) -> dict[str, Any]:
    """The issue's record: dataset, model, features_on, gpu_cache_frac, host_memory_gb, epoch_s,
    resident_epoch_s, hit_rate, device (+ the disk tier's fields)."""
    return {"dataset": dataset, "model": row["model"], "features_on": row.get("features_on_label", row["features_in"]),
            "gpu_cache_frac": row.get("gpu_cache_frac", 0.0), "host_memory_gb": row.get("host_memory_gb"),
            "epoch_s": row["epoch_s_extrapolated"],
            "resident_epoch_s": resident["epoch_s_extrapolated"] if resident else None,
            "ratio_vs_resident": row["per_batch_s"] / resident["per_batch_s"] if resident else None,
            "hit_rate": row.get("hit_rate"), "device": device, "batches_timed": row["batches_timed"] * row["rounds"],
            "batches_per_epoch": row["batches_per_epoch"],
            "epoch_note": "epoch_s = median timed round's per-batch time x batches per epoch (extrapolated)",
            **extra}


def prepare_disk(ds: Any, name: str, shared: dict[str, Any], datasets: dict[str, Any],
                  args: Any) -> bool:
    """Write the table to ``--disk-dir`` and probe the disk's random reads there; False if that failed."""
    d = Path(args.disk_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-features.npy"
    try:
        datasets[name]["disk_file"] = write_table(ds.features, path)
        shared["disk_probe"] = datasets[name]["disk_probe"] = probe_disk(path)
    except OSError as exc:
        _log.error("%s: the disk way cannot run: %s", name, exc)
        datasets[name]["disk_error"] = str(exc)
        path.unlink(missing_ok=True)
        return False
    shared["disk_file"] = path
    print(f"  table written to {path} in {datasets[name]['disk_file']['write_s']:.1f} s; disk random 4 KiB reads: "
          f"{shared['disk_probe']['GBps']:.2f} GB/s", flush=True)
    return True


def disk_fields(w: Any, ds: Any, shared: dict[str, Any], args: Any) -> dict[str, Any]:
    """The disk tier's record fields: its read bandwidth in the timed rounds, the probe, the row check."""
    disk = [s["disk"] for s in w.store_stats]
    read_bytes = sum(d["read_bytes"] for d in disk)
    io_s = sum(d["io_seconds"] for d in disk)
    check = verify_rows(w.loader.graph, ds, w.loader.features, as_unified(ds.features), args,
                              args.verify_batches)
    return {"disk_read_GBps": read_bytes / io_s / 1e9 if io_s else None, "disk_read_bytes": read_bytes,
            "disk_reads": sum(d["reads"] for d in disk), "disk_io_s": io_s,
            "disk_probe_GBps": shared["disk_probe"]["GBps"], "disk_probe": shared["disk_probe"],
            "host_memory_gb": w.loader.features.tiers()["host"]["bytes"] / 1e9, **check}


def records(results: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """One record per (dataset, model, way) in the issue's fields, against gpu_resident of the same run."""
    out = []
    for r in results:
        resident = next((x for x in results if x["dataset"] == r["dataset"] and x["model"] == r["model"]
                         and x["way"] == "gpu_resident"), None)
        extra = {k: r[k] for k in ("rows_match", "disk_read_GBps", "disk_probe_GBps", "rows_checked",
                                   "checksum_store", "checksum_table") if k in r}
        rec = record(r["dataset"], {**r, "features_on_label": r["way"]}, resident, device, **extra)
        if resident and r["way"] != "gpu_resident":
            pairs = [a / b for a, b in zip(r["per_batch_s_rounds"], resident["per_batch_s_rounds"])]
            rec["ratio_vs_resident_median_of_rounds"] = sorted(pairs)[len(pairs) // 2] if pairs else None
        out.append(rec)
    return out
