"""B5's records turned into results (`benchmarks/multi_node.py`): a run's record, the bar checks, the plot, the
payload of results/<name>.json, and ``--merge`` of several result files."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, print_table, write_result

SCALING_BAR, ACC_BAR, BW_BAR = 0.90, 0.005, 0.70
"""Bars: N-node epoch <= 1 / (SCALING_BAR x N) of the 1-GPU epoch (0.55x at N = 2), test accuracy within
ACC_BAR, the remote fetch at >= BW_BAR of NCCL all_to_all's bandwidth at the batch's message size."""


def _epoch_s(run: dict[str, Any]) -> tuple[float, list[float]]:
    times = [e["epoch_s"] for e in run["epochs"]]
    return (statistics.median(times[1:]) if len(times) > 1 else times[0]), times


def _stage_ms(remote: dict[str, Any], stage: str) -> float:
    """Mean ms per batch of an exchange stage: ``counts``, ``ids`` and ``exchange`` (GPU time on CUDA) over the
    exchanges whose times are folded in (``timed_exchanges``; every exchange records all three, zero where nothing
    is asked), the host stages over every exchange."""
    n = remote.get("timed_exchanges", remote["exchanges"]) if stage in ("counts", "ids", "exchange") else \
        remote["exchanges"]
    return remote.get(f"{stage}_seconds", 0.0) / max(n, 1) * 1e3


def record(dataset: str, run: dict[str, Any], mode: str, batch: int, cache: str = "none") -> dict[str, Any]:
    nodes = run["world_size"]
    epoch_s, times = _epoch_s(run)
    rec: dict[str, Any] = {"dataset": dataset, "nodes": nodes, "gpus_per_node": 1, "mode": mode,
                           "batch_per_rank": batch, "global_batch": batch * nodes, "epoch_s": epoch_s,
                           "epochs_s": times,
                           "test_acc": run["test_acc"], "remote_bytes_per_batch": 0.0, "hit_rate_local": 1.0,
                           "device": run["device_name"], "backend": run["backend"] if nodes > 1 else None,
                           "gpu_cache": cache if nodes > 1 else "none", "nccl_transport": run.get("nccl_transport")}
    last = run["epochs"][-1]  # where the last epoch's time went (slowest rank per column): the loader's stages
    rec["breakdown_s"] = {k: last.get(k) for k in ("sample_s", "gather_s", "train_s", "wait_s")}
    rec["steps"] = last.get("batches")
    stores = [s for s in run["stores"] if s is not None]
    if nodes > 1 and stores:
        rem = [s["remote"] for s in stores]
        rec["rows_per_batch"] = statistics.mean(sum(s[t]["rows"] for t in s) / max(s["remote"]["exchanges"], 1)
                                                for s in stores)  # input rows of a rank's batch, every tier
        got = sum(r["received_rows"] for r in rem)
        rec["row_bytes"] = sum(r["received_bytes"] for r in rem) / got if got else None
        hits = sum(r.get("remote_cache_rows", 0) for r in rem)
        rec["remote_cache_hit_rate"] = hits / max(hits + sum(r["received_rows"] for r in rem), 1)
        # each exchange stage per batch (ms; GPU time on CUDA), the slowest rank: counts (sort by owner +
        # the counts all_gather, the one host sync), ids (their all_to_all), rows (owner's gather + rows
        # all_to_all + scatter), wall (host time of the whole call) = submit (host time of its collectives and
        # what follows them, in the loader's turns; submit_cpu: the thread's CPU time in them) + prepare (what
        # precedes them, between the turns) + counts_wait (the host's wait for the counts, between the turns)
        rec["stage_ms_per_batch"] = {
            k: max(_stage_ms(r, k) for r in rem)
            for k in ("counts", "ids", "exchange", "wall", "submit", "submit_cpu", "prepare", "counts_wait")}
        rec["remote_bytes_per_batch"] = statistics.mean(r["received_bytes"] / max(r["exchanges"], 1) for r in rem)
        rec["id_bytes_per_batch"] = statistics.mean(r["id_bytes"] / max(r["exchanges"], 1) for r in rem)
        rec["hit_rate_local"] = statistics.mean(1.0 - r["hit_rate"] for r in rem)
        rec["hit_rates"] = {t: statistics.mean(s[t]["hit_rate"] for s in stores) for t in stores[0]}
        rec["remote_fetch_GBps"] = min(r["received_bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0 for r in rem)
        rec["rows_exchange_GBps"] = min(r["received_bytes"] / r["exchange_seconds"] / 1e9
                                        if r["exchange_seconds"] else 0.0 for r in rem)
        bw = run.get("alltoall") or []
        if bw:
            rec["alltoall_message_bytes"] = bw[0]["message_bytes"]
            rec["nccl_alltoall_GBps"] = bw[0]["GBps"]
            rec["alltoall_curve"] = {b["message_bytes"]: b["GBps"] for b in bw}
            rec["fetch_over_alltoall"] = rec["remote_fetch_GBps"] / bw[0]["GBps"] if bw[0]["GBps"] else None
            rec["rows_over_alltoall"] = rec["rows_exchange_GBps"] / bw[0]["GBps"] if bw[0]["GBps"] else None
    return rec


def ratio_bar(nodes: int) -> float:
    """The N-node epoch over the 1-GPU epoch that the bar allows (scaling efficiency `SCALING_BAR`)."""
    return 1.0 / (SCALING_BAR * nodes)


def bars(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in records}):
        one = next((r for r in records if r["dataset"] == ds and r["nodes"] == 1), None)
        for r in records:
            if r["dataset"] != ds or r["nodes"] == 1 or one is None:
                continue
            key = f"{ds}/{r['mode']}" + ("" if r["gpu_cache"] == "none" else f"/{r['gpu_cache']}") + \
                (f"#{r['repeat']}" if "repeat" in r else "")
            b = {"epoch_ratio": r["epoch_s"] / one["epoch_s"], "acc_diff": r["test_acc"] - one["test_acc"],
                 "fetch_over_alltoall": r.get("fetch_over_alltoall")}
            b["ratio_bar"] = ratio_bar(r["nodes"])
            b["time_met"] = b["epoch_ratio"] <= b["ratio_bar"]
            b["acc_met"] = abs(b["acc_diff"]) <= ACC_BAR
            b["bw_met"] = None if b["fetch_over_alltoall"] is None else b["fetch_over_alltoall"] >= BW_BAR
            out[key] = b
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    datasets = sorted({r["dataset"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, ds in enumerate(datasets):
        rs = [r for r in records if r["dataset"] == ds]
        for j, r in enumerate(rs):
            label = "1 GPU" if r["nodes"] == 1 else f"{r['nodes']} nodes {r['mode']} cache {r['gpu_cache']}"
            ax.bar(6 * i + j, r["epoch_s"], color=["#8c8c8c", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"][j % 5],
                   label=label if i == 0 else None)
            ax.text(6 * i + j, r["epoch_s"], f"{r['test_acc']:.3f}", ha="center", va="bottom", fontsize=7)
        one = next((r for r in rs if r["nodes"] == 1), None)
        nodes = max(r["nodes"] for r in rs)
        if one and nodes > 1:
            bar = ratio_bar(nodes)
            ax.plot([6 * i + 0.6, 6 * i + len(rs) - 0.6], [bar * one["epoch_s"]] * 2, "k--", lw=1,
                    label=f"bar {bar:.2f} x 1 GPU" if i == 0 else None)
    ax.set_xticks([6 * i + 1 for i in range(len(datasets))], datasets)
    ax.set_ylabel("epoch (s); label: test accuracy")
    ax.legend(fontsize=7)
    ax = axes[1]
    rs = [r for r in records if r.get("nccl_alltoall_GBps")]
    for i, r in enumerate(rs):
        ax.bar([3 * i, 3 * i + 1], [r["remote_fetch_GBps"], r["nccl_alltoall_GBps"]], color=["#d62728", "#8c8c8c"])
    ax.set_xticks([3 * i + 0.5 for i in range(len(rs))],
                  [f"{r['dataset']} {r['mode']}\n{r['gpu_cache']}\n{r['alltoall_message_bytes'] / 2**20:.1f} MiB"
                   for r in rs], fontsize=7)
    ax.set_ylabel("GB/s per rank")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#d62728", "#8c8c8c")],
              labels=["remote fetch", "all_to_all at that size"], fontsize=7)
    nodes = max(r["nodes"] for r in records)
    fig.suptitle(f"features sharded over {nodes} nodes vs 1 GPU ({records[0]['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_payload(args: argparse.Namespace, records: list[dict[str, Any]], total_s: float) -> dict[str, Any]:
    return {
        "description": f"GraphSAGE with the features sharded over {args.nodes} simulated nodes (torchrun launches, one "
                       "GPU each, no shared segment) vs 1 GPU with the whole table",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bars": {"time": f"N-node epoch <= 1 / ({SCALING_BAR} N) x the 1-GPU epoch (strong: same global batch; "
                         f"0.55x at N = 2)", "accuracy": f"within {ACC_BAR}",
                 "bandwidth": f"remote fetch >= {BW_BAR} x NCCL all_to_all at the batch's message size"},
        "notes": {"epoch_s": "median of the epochs after the first; slowest rank",
                  "global_batch": "seeds a step over all ranks, batch_per_rank x nodes (strong: the 1-GPU batch "
                                  "exactly; a --batch-size that --nodes does not divide is refused)",
                  "remote_bytes_per_batch": "feature bytes a rank receives from the other nodes per training batch "
                                            "(ids not counted: id_bytes_per_batch)",
                  "remote_cache_hit_rate": "rows of other shards found in the rank's own GPU cache / all rows of "
                                           "other shards its batches needed",
                  "stage_ms_per_batch": "each exchange stage's mean per batch over every batch (one where no rank "
                                        "asks for a row included: its ids and exchange stages take 0), slowest "
                                        "rank (GPU time): counts = sort by "
                                        "owner + counts all_gather (the one host sync), ids = ids all_to_all, "
                                        "exchange = owner's gather + rows all_to_all + scatter; wall = host time "
                                        "= submit (its collectives and what follows them, in the loader's turns; "
                                        "submit_cpu: the thread's CPU time in them) + prepare (the sort, buffers "
                                        "and split sizes, between the turns) + counts_wait (host wait for the "
                                        "counts, between the turns)",
                  "remote_fetch_GBps": "received bytes / GPU time of the remote tier's fetches (sort, counts "
                                       "all_gather, ids all_to_all, the owner's gather, rows all_to_all), slowest rank",
                  "rows_exchange_GBps": "received bytes / GPU time of the owner's gather and the rows all_to_all",
                  "nccl_alltoall_GBps": "all_to_all_single of the mean remote bytes per batch, each rank to the "
                                        "other, same backend, after training; slowest rank",
                  "rows_over_alltoall": "rows_exchange_GBps / nccl_alltoall_GBps (the rows stage alone)",
                  "nccl_transport": "how NCCL linked the processes (its NCCL_DEBUG=INFO log)"},
        "records": records, "summary": bars(records), "total_s": total_s}


def merge(args: argparse.Namespace) -> None:
    """results/<name>.json and its plot from the records of several result files."""
    docs = [json.loads(p.read_text()) for p in args.merge]
    records = [r for d in docs for r in d["records"]]
    payload = result_payload(args, records, sum(d.get("total_s", 0.0) for d in docs))
    payload.update(merged_from=[{"command": d.get("command"), "date": d.get("date"), "machine": d.get("machine")}
                                for d in docs])
    path = write_result(args.name, payload)
    plot(records, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    print_table([{"run": k, **v} for k, v in payload["summary"].items()])
