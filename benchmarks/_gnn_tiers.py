"""B2's feature-store ways (`benchmarks/gnn_epoch.py`): the GPU cache, and host memory plus disk.

- ``datapath_cache``: a `FeatureStore` over the pinned table with a GPU cache of the hottest rows
  (``--gpu-cache-frac`` of the feature bytes, ranked by presampling the run's sampler), the graph
  on the GPU when it fits;
- ``datapath_disk``: the table written to a ``.npy`` file (data page-aligned, `write_table`), a store
  with the same GPU cache and ``--host-memory-frac`` of the feature bytes in pinned host memory,
  ``--disk-superbatch-frac`` of it as superbatch staging (the host tier gets the rest); the other
  rows are read from the file (O_DIRECT), a superbatch of batches at a time (random reads or a
  scan, by the disk's costs).  The disk is probed in the same run (random 4 KiB reads, many in
  flight; sequential 1 MiB reads), and the rows the store returns are compared with the table's:
  every batch of a full timed epoch (``--disk-full-epoch``) and ``--verify-batches`` more.
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

from datapath.features import DiskOptions, FeatureStore, presample_hotness, TableFile, write_table
from datapath.features.scan import BOUNCE_BUFFERS, BOUNCE_BYTES, probe_disk
from datapath.apps import train_epoch
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


def warm_up(way: str, loader: NeighborLoader, model: Any, opt: Any, args: Any) -> Any:
    """``args.warmup`` untimed batches; for ``datapath_disk`` with ``--disk-full-epoch`` one batch read row by row
    (no prefetching, so no superbatch schedule: a superbatch would read the disk rows of dozens of batches)."""
    if way == "datapath_disk" and args.disk_full_epoch:
        loader.prefetch = 0
        try:
            return train_epoch(model, loader, opt, max_batches=1)
        finally:
            loader.prefetch = args.prefetch
    return train_epoch(model, loader, opt, max_batches=args.warmup)


def write_file(features: torch.Tensor, path: Path) -> dict[str, Any]:
    """Write the (N, F) host table as a page-aligned ``.npy`` file (`write_table`, fsynced)."""
    arr = host_of(features).numpy()
    need = arr.nbytes + (1 << 30)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise OSError(f"{path.parent} has {free / 2**30:.1f} GiB free; the table needs {need / 2**30:.1f} GiB")
    t0 = time.perf_counter()
    tf = write_table(path, arr)
    return {"path": str(path), "bytes": os.path.getsize(path), "data_offset": tf.offset,
            "write_s": time.perf_counter() - t0}


def disk_store(path: Path, hot: torch.Tensor, args: Any, costs: Any) -> tuple[FeatureStore, float]:
    """The disk way's store: ``--host-memory-frac`` of the feature bytes in host memory, of which
    ``--disk-superbatch-frac`` is superbatch staging (0: batches read row by row, as before)."""
    t0 = time.perf_counter()
    nbytes = os.path.getsize(path)
    host = int(args.host_memory_frac * nbytes)
    staging = int(args.disk_superbatch_frac * host) - BOUNCE_BUFFERS * BOUNCE_BYTES if args.disk_superbatch_frac else 0
    opts = DiskOptions(superbatch=max(staging, 0) or None, buffers=args.disk_buffers, costs=costs)
    fs = FeatureStore(path, gpu_cache=args.gpu_cache_frac, host_memory=host, hotness=hot, disk=opts)
    return fs, time.perf_counter() - t0


class CheckedLoader:
    """``loader``'s batches, each ``x`` compared bit for bit with ``reference[input_nodes]`` (on the consumer's
    stream, after the batch is handed over): ``mismatches``, ``rows``, ``sum_store``/``sum_table``."""

    def __init__(self, loader: NeighborLoader, reference: torch.Tensor) -> None:
        self.loader, self.reference, self.device = loader, reference, loader.device
        self.rows = self.batches = 0
        self._bad = torch.zeros((), dtype=torch.int64, device=loader.device)
        self._sums = torch.zeros(2, dtype=torch.float64, device=loader.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        try:
            for b in it:
                ref = gather_rows(self.reference, b.input_nodes)
                self._bad += (b.x.view(torch.int32) != ref.view(torch.int32)).any(1).sum()
                self._sums[0] += b.x.double().sum()
                self._sums[1] += ref.double().sum()
                self.rows += b.x.shape[0]
                self.batches += 1
                yield b
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def result(self) -> dict[str, Any]:
        s = self._sums.tolist()
        bad = int(self._bad)
        return {"rows_match": bad == 0 and s[0] == s[1], "rows_checked": self.rows, "batches_checked": self.batches,
                "rows_mismatched": bad, "checksum_store": s[0], "checksum_table": s[1]}


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


def _epoch(row: dict[str, Any]) -> tuple[float, bool]:
    """A way's epoch seconds and whether they were measured over a whole epoch (else extrapolated)."""
    if row.get("epoch_measured"):
        return row["time_s"], True
    if row.get("full_epoch_s") is not None:
        return row["full_epoch_s"], True
    return row["epoch_s_extrapolated"], False


def record(dataset: str, row: dict[str, Any], resident: dict[str, Any] | None, device: str, **extra: Any
           ) -> dict[str, Any]:
    """The issue's record: dataset, model, features_on, gpu_cache_frac, host_memory_gb, epoch_s,
    resident_epoch_s, hit_rate, device (+ the disk tier's fields).  Whole epochs, where measured, beat
    extrapolations (``epoch_measured``, ``resident_epoch_measured``)."""
    epoch_s, measured = _epoch(row)
    res_s, res_measured = _epoch(resident) if resident else (None, False)
    return {"dataset": dataset, "model": row["model"], "features_on": row.get("features_on_label", row["features_in"]),
            "gpu_cache_frac": row.get("gpu_cache_frac", 0.0), "host_memory_gb": row.get("host_memory_gb"),
            "epoch_s": epoch_s, "resident_epoch_s": res_s,
            "ratio_vs_resident": row["per_batch_s"] / resident["per_batch_s"] if resident else None,
            "epoch_ratio_vs_resident": epoch_s / res_s if res_s else None,
            "hit_rate": row.get("hit_rate"), "device": device, "batches_timed": row["batches_timed"] * row["rounds"],
            "batches_per_epoch": row["batches_per_epoch"], "epoch_measured": measured,
            "resident_epoch_measured": res_measured,
            "epoch_note": ("epoch_s: one whole epoch, measured" if measured else
                           "epoch_s = median timed round's per-batch time x batches per epoch (extrapolated)")
            + ("; resident_epoch_s: gpu_resident's whole epoch, measured in the same run" if res_measured else ""),
            **extra}


def prepare_disk(ds: Any, name: str, shared: dict[str, Any], datasets: dict[str, Any],
                  args: Any) -> bool:
    """Write the table to ``--disk-dir`` and probe the disk's random reads there; False if that failed."""
    d = Path(args.disk_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-features.npy"
    try:
        datasets[name]["disk_file"] = write_file(ds.features, path)
        t0 = time.perf_counter()
        costs = probe_disk(TableFile.open(path), random_reads=60_000, depths=(64, 256, 1024), seq_bytes=2 << 30)
        shared["disk_costs"] = costs
        shared["disk_probe"] = datasets[name]["disk_probe"] = {**costs.as_dict(), "GBps": costs.random_GBps,
                                                               "probe_s": time.perf_counter() - t0}
    except OSError as exc:
        _log.error("%s: the disk way cannot run: %s", name, exc)
        datasets[name]["disk_error"] = str(exc)
        path.unlink(missing_ok=True)
        return False
    shared["disk_file"] = path
    print(f"  table written to {path} in {datasets[name]['disk_file']['write_s']:.1f} s; disk random 4 KiB reads: "
          f"{shared['disk_probe']['GBps']:.3f} GB/s ({shared['disk_probe']['iops']:.0f} IOPS), sequential 1 MiB "
          f"reads: {shared['disk_probe']['seq_GBps']:.2f} GB/s", flush=True)
    return True


def disk_fields(w: Any, ds: Any, shared: dict[str, Any], args: Any) -> dict[str, Any]:
    """The disk tier's record fields: its read bandwidth in the timed rounds (bytes read / time reading; and
    the rows' own bytes / the same time), the probe, each superbatch, the row checks (every batch of the
    timed epoch when it was checked, and ``--verify-batches`` batches of another loader)."""
    disk = [s["disk"] for s in w.store_stats]
    read_bytes = sum(d["read_bytes"] for d in disk)
    io_s = sum(d["io_seconds"] for d in disk)
    supers = [x for d in disk for x in d.get("superbatches", [])]
    useful = sum(x["useful_bytes"] for x in supers) + sum(d["rows"] - d.get("staged_rows", 0) for d in disk) * \
        w.loader.features.row_bytes
    check = verify_rows(w.loader.graph, ds, w.loader.features, as_unified(ds.features), args,
                        args.verify_batches)
    tiers = w.loader.features.tiers()
    host_bytes = tiers["host"]["bytes"] + tiers["disk"].get("staging_bytes", 0)
    out = {"disk_read_GBps": read_bytes / io_s / 1e9 if io_s else None, "disk_read_bytes": read_bytes,
           "disk_useful_bytes": useful, "disk_useful_GBps": useful / io_s / 1e9 if io_s else None,
           "disk_reads": sum(d["reads"] for d in disk), "disk_io_s": io_s,
           "disk_probe_GBps": shared["disk_probe"]["GBps"], "disk_probe": shared["disk_probe"],
           "host_memory_gb": host_bytes / 1e9, "host_tier_gb": tiers["host"]["bytes"] / 1e9,
           "staging_gb": tiers["disk"].get("staging_bytes", 0) / 1e9,
           "superbatches": [{k: x[k] for k in ("number", "batches", "skipped", "rows", "useful_bytes", "mode",
                                               "reads", "read_bytes", "io_s", "read_GBps", "predicted_s", "plan_s")
                             if k in x} for x in supers],
           "superbatch_modes": {m: sum(1 for x in supers if x["mode"] == m) for m in {x["mode"] for x in supers}},
           "verify_other_loader": check}
    epoch_check = getattr(w, "epoch_check", None)
    out.update(epoch_check if epoch_check is not None else check)
    return out


def records(results: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """One record per (dataset, model, way) in the issue's fields, against gpu_resident of the same run."""
    out = []
    for r in results:
        resident = next((x for x in results if x["dataset"] == r["dataset"] and x["model"] == r["model"]
                         and x["way"] == "gpu_resident"), None)
        extra = {k: r[k] for k in ("rows_match", "disk_read_GBps", "disk_probe_GBps", "rows_checked",
                                   "checksum_store", "checksum_table", "disk_useful_GBps", "staging_gb",
                                   "host_tier_gb", "superbatch_modes") if k in r}
        rec = record(r["dataset"], {**r, "features_on_label": r["way"]}, resident, device, **extra)
        if resident and r["way"] != "gpu_resident":
            pairs = [a / b for a, b in zip(r["per_batch_s_rounds"], resident["per_batch_s_rounds"])]
            rec["ratio_vs_resident_median_of_rounds"] = sorted(pairs)[len(pairs) // 2] if pairs else None
        out.append(rec)
    return out
