"""Row-split variants on sampled blocks (the training path): the model's plan against several rows per team.

Samples GraphSAGE blocks (fanouts 15, 10, 5, batch 1024) from the products-shaped synthetic graph on the GPU and
times, per block and width, ``aggregate(block, x)`` (mean; CUDA events, `benchmarks._common.cuda_time_ms`; a
block is trusted: no probe) with the model's plan, with one row per team, ``rows_per_team`` 2..16, rows by
length, and on the same block without its fanout bound (``no_bound``: no ``max_degree``, so the row split also
launches for long rows and, in half precision, sums into a float32 buffer); and the gradient's transposed
direction with its plan and with 8 and 32 rows per team.  Prints one line per case and writes
``$OUT/block_rows_probe.json``.
Run on the GPU machine:  PYTHONPATH=src:. python scripts/gpu_block_rows_probe.py
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from benchmarks._common import cuda_time_ms
from datapath.graph import generate
from datapath.ops import aggregate, as_csr, plan_aggregation, transposed_aggregator
from datapath.sampling import Block, NeighborSampler


def main() -> None:
    t0 = time.perf_counter()
    ds = generate("products", device="cuda", progress=False)
    graph = ds.graph.to("cuda")
    seeds = torch.randperm(graph.num_nodes, device="cuda")[:1024]
    blocks = NeighborSampler([15, 10, 5]).sample(graph, seeds)
    rows = []
    for li, b in enumerate(blocks):
        n, e = b.num_dst_nodes, b.indices.numel()
        for f, dt in ((100, torch.float32), (256, torch.float32), (256, torch.bfloat16), (64, torch.float32)):
            x = torch.randn(b.num_src_nodes, f, device="cuda").to(dt)
            model = plan_aggregation(b, f, dt)  # may take several rows per team (the block's fanout bounds its rows)
            base = model.replace(rows_per_team=1)
            plans = {"model": model, "one_row": base, "deg": base.replace(row_order="degree")}
            for r in (2, 4, 8, 16):
                plans[f"r{r}"] = base.replace(rows_per_team=r)
            unbounded = Block(b.indptr, b.indices, b.src_nodes, b.num_dst_nodes, trusted=True)  # no fanout bound
            plan_unb = plan_aggregation(unbounded, f, dt)
            rec = {"layer": li, "dst": n, "edges": e, "avg_deg": e / max(1, n), "F": f, "dtype": str(dt)[6:],
                   "device": torch.cuda.get_device_name()}
            with torch.no_grad():
                ref = aggregate(b, x, "mean", plan=base).float()  # (checked against the reference by tests/ops)
                for k, p in plans.items():
                    got = aggregate(b, x, "mean", plan=p).float()
                    assert torch.allclose(got, ref, atol=1e-2, rtol=1e-2), k
                    rec[k] = cuda_time_ms(lambda p=p, x=x, b=b: aggregate(b, x, "mean", plan=p), warmup=3, repeat=30)
                assert torch.allclose(aggregate(unbounded, x, "mean", plan=plan_unb).float(), ref, atol=1e-2, rtol=1e-2)
                rec["no_bound"] = cuda_time_ms(lambda: aggregate(unbounded, x, "mean", plan=plan_unb), warmup=3,
                                               repeat=30)
            y = torch.randn(n, f, device="cuda").to(dt)
            run_t = transposed_aggregator(b, f, dt, "mean")
            rec["T:model"] = cuda_time_ms(lambda: run_t(y), warmup=3, repeat=30)
            view_t = as_csr(b).transposed()  # the gradient's CSR: a row per source node, length unknown
            base_t = plan_aggregation(view_t, f, dt).replace(rows_per_team=1)
            with torch.no_grad():
                ref_t = aggregate(view_t, y, plan=base_t).float()
                for r in (8, 32):
                    p = base_t.replace(rows_per_team=r)
                    assert torch.allclose(aggregate(view_t, y, plan=p).float(), ref_t, atol=1e-2, rtol=1e-2)
                    rec[f"T:r{r}"] = cuda_time_ms(lambda p=p: aggregate(view_t, y, plan=p), warmup=3, repeat=30)
            rows.append(rec)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                           if k != "device"), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "block_rows_probe.json"
    out.write_text(json.dumps({"records": rows, "wall_s": time.perf_counter() - t0}, indent=1))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
