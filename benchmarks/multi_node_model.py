"""docs/multi_node.md's model of a strong-scaling epoch: bytes per batch against link bandwidth, from a measured result.

    PYTHONPATH=src:. python benchmarks/multi_node.py --model benchmarks/results/multi_node.json

(`benchmarks/multi_node.py --model` prints it; no GPU needed.)
"""
from __future__ import annotations

import math
from typing import Any

LINKS_GBPS = {"IB HDR 200 Gb/s": 25.0, "IB NDR 400 Gb/s": 50.0}
ROW_BYTES = {"products": 400, "papers": 512}  # for records that do not carry row_bytes (or steps)
STEPS = {"products": 192}


def model(records: list[dict[str, Any]], dataset: str, nodes: tuple[int, ...] = (2, 4, 8, 16),
          links: dict[str, float] | None = None, fixed_share: float | None = None,
          fixed_ms: float | None = None) -> list[dict[str, Any]]:
    """docs/multi_node.md's model of a strong-scaling epoch (the 1-GPU batches cut over N ranks), per link.

    From the records of ``dataset``: the 1-GPU epoch ``T1`` of ``S`` steps at batch ``B``; the rows a rank's
    batch reads at the strong and weak per-rank batches of the measured N0-rank runs, fitted as
    ``R(b) = R(B) (b / B)^a``; the strong run's step.  Per step and rank at N ranks (``b = B / N``):

    - bytes = R(b) (1 - 1/N) (1 - h) row_bytes  (h: the remote cache's hit rate, 0 without a cache);
    - network time = bytes / link; the exchange stage = that + its fixed cost per batch, measured as the
      strong run's exchange time per batch minus its bytes over NCCL all_to_all's bandwidth there;
    - compute time = t1 (f + (1 - f) R(b) / R(B)), t1 = T1 / S, f the per-step share that does not shrink
      with the batch, solved from the measured strong step (the exchange assumed hidden; clamped to 0..1);
    - epoch = S x max(compute, exchange) (the exchange runs in the loader's stage, beside the step):
      ``epoch_link_s`` with a zero fixed cost (the exchange at link speed), ``epoch_s`` with the measured one.

    ``fixed_share``, ``fixed_ms``: use these instead of the measured f and exchange fixed cost (what-if rows).
    Returns one row per N and link (plus the N0 rows "measured" and its model), epochs in seconds.
    """
    links = links or LINKS_GBPS
    rs = [r for r in records if r["dataset"] == dataset]
    one = next(r for r in rs if r["nodes"] == 1)
    strongs = [r for r in rs if r["mode"] == "strong"]
    # without a cache if measured, else one whose cache took no remote rows (own:...: the remote bytes of no cache)
    strong = min(strongs, key=lambda r: (r["gpu_cache"] != "none", bool(r.get("remote_cache_hit_rate"))))
    weak = next((r for r in rs if r["mode"] == "weak" and r["gpu_cache"] == "none"), None)
    n0, big_b = strong["nodes"], one["batch_per_rank"]
    steps = one.get("steps") or STEPS[dataset]
    row_bytes = strong.get("row_bytes") or ROW_BYTES[dataset]

    def rows(r: dict[str, Any]) -> float:  # input rows of one rank's batch (all tiers)
        if r.get("rows_per_batch"):
            return r["rows_per_batch"]
        return r["remote_bytes_per_batch"] / ((1 - 1 / r["nodes"]) * row_bytes)

    r_strong = rows(strong)
    a = math.log(rows(weak) / r_strong) / math.log(n0) if weak else 0.7
    r_big = r_strong * n0 ** a  # R(B)
    t1 = one["epoch_s"] / steps
    share = (r_strong / r_big)
    t_strong = strong["epoch_s"] / steps
    f = min(1.0, max(0.0, (t_strong / t1 - share) / (1 - share))) if fixed_share is None else fixed_share
    per_batch = strong["remote_bytes_per_batch"]
    ex_s = per_batch / (strong["remote_fetch_GBps"] * 1e9) if strong.get("remote_fetch_GBps") else 0.0
    link_s = per_batch / (strong["nccl_alltoall_GBps"] * 1e9) if strong.get("nccl_alltoall_GBps") else 0.0
    fixed = max(0.0, ex_s - link_s) if fixed_ms is None else fixed_ms / 1e3
    out = [{"gpus": n0, "link": "measured", "gpu_cache": strong["gpu_cache"], "epoch_s": strong["epoch_s"],
            "ratio": strong["epoch_s"] / one["epoch_s"],
            "MB_per_batch": strong["remote_bytes_per_batch"] / 1e6, "exchange_ms": ex_s * 1e3,
            "fixed_ms": fixed * 1e3, "fixed_share": f, "alpha": a}]
    t_c0 = t1 * (f + (1 - f) * share)  # the check: the model at the measured run (its link, its exchange)
    out.append({"gpus": n0, "link": "model of the measured run", "MB_per_batch": strong["remote_bytes_per_batch"] / 1e6,
                "compute_ms": t_c0 * 1e3, "exchange_ms": ex_s * 1e3, "epoch_s": steps * max(t_c0, ex_s),
                "ratio": steps * max(t_c0, ex_s) / one["epoch_s"]})
    for n in nodes:
        r_b = r_big * (1 / n) ** a
        nbytes = r_b * (1 - 1 / n) * row_bytes * (1 - (strong.get("remote_cache_hit_rate") or 0.0))
        t_c = t1 * (f + (1 - f) * r_b / r_big)
        for name, gbps in links.items():
            t_net = nbytes / (gbps * 1e9)
            out.append({"gpus": n, "link": name, "MB_per_batch": nbytes / 1e6, "compute_ms": t_c * 1e3,
                        "network_ms": t_net * 1e3, "exchange_ms": (fixed + t_net) * 1e3,
                        "epoch_link_s": steps * max(t_c, t_net), "epoch_s": steps * max(t_c, fixed + t_net),
                        "ratio": steps * max(t_c, fixed + t_net) / one["epoch_s"]})
    keys = list(dict.fromkeys(k for row in out for k in row))
    return [{k: row.get(k) for k in keys} for row in out]
