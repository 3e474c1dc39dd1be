"""Row-split variants on B3's graphs: the order teams take rows and column chunks, team width, and the other kernels.

For each seed-shaped graph, width and dtype, the forward time (CUDA events, `benchmarks._common.cuda_time_ms`) of
plans forced through the public API: the model's ``rows`` plan; the same with ``row_order="degree"`` (and with
``sweep="columns"``, also at ``cf=1``, where a row has several column chunks, and with two chunks of half the
lanes where it has one); a warp per row (narrower vectors, 32 lanes) in both orders; half the lanes a row with
two vectors each (rows by length); 4 and 16 rows per team; ``groups``, ``tensor_core`` (half) and ``cusparse``.
The graphs are symmetric: the gradient's transposed CSR has the same rows.  Prints one line per case and writes
``$OUT/rows_order_probe.json`` (or ./rows_order_probe.json).
Run on the GPU machine:  PYTHONPATH=src:. python scripts/gpu_rows_order_probe.py [--graphs ppi,artist] [--widths 64,128]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from benchmarks._common import cuda_time_ms
from datapath.ops import aggregate, plan_aggregation
from datapath.testing import seed_graph

GRAPHS = ("citeseer", "ppi", "OVCAR-8H", "amazon0505", "artist", "soc-BlogCatalog")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def variants(g, f: int, dt: torch.dtype) -> dict[str, object]:
    base = plan_aggregation(g, f, dt).replace(rows_per_team=1)
    out: dict[str, object] = {"rows": base, "rows_deg": base.replace(row_order="degree")}
    vec = base.vec  # one row per warp: narrower vectors, 32 lanes (at least 32 vectors per row)
    while vec > 1 and f // vec < 32:
        vec //= 2
    if base.dw < 32 and vec < base.vec and f // vec >= 32:
        warp = base.replace(vec=vec, dw=32, cf=2 if f // vec > 32 else 1)
        out["warp"] = warp
        out["warp_deg"] = warp.replace(row_order="degree")
    if base.chunks > 1:
        out["deg_cols"] = base.replace(row_order="degree", sweep="columns")
        out["deg_cols_cf1"] = base.replace(row_order="degree", sweep="columns", cf=1)
    if base.chunks == 1 and base.dw >= 4:  # two column chunks of half the lanes, a strip at a time
        out["deg_cols_2chunks"] = base.replace(row_order="degree", dw=base.dw // 2, sweep="columns")
    if base.cf == 1 and base.dw >= 4:  # half the lanes per row, two vectors each (more rows per warp)
        out["deg_cf2"] = base.replace(row_order="degree", dw=base.dw // 2, cf=2)
        out["deg_cf2_u8"] = base.replace(row_order="degree", dw=base.dw // 2, cf=2, unroll=4)
    for r in (4, 16):
        out[f"multi{r}"] = base.replace(rows_per_team=r)
    out["groups"] = base.replace(kernel="groups")
    if dt != torch.float32:
        out["tensor_core"] = base.replace(kernel="tensor_core")
    out["cusparse"] = base.replace(kernel="cusparse")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--widths", default="16,64,128,602")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rows: list[dict] = []
    t0 = time.perf_counter()
    for name in args.graphs.split(","):
        g, _ = seed_graph(name, device="cuda")
        for dname in args.dtypes.split(","):
            dt = DTYPES[dname]
            for f in map(int, args.widths.split(",")):
                x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt)
                rec: dict = {"graph": name, "F": f, "dtype": dname, "device": torch.cuda.get_device_name()}
                with torch.no_grad():
                    for label, p in variants(g, f, dt).items():
                        try:
                            rec[label] = cuda_time_ms(lambda p=p, g=g, x=x: aggregate(g, x, plan=p), warmup=2,
                                                      repeat=args.repeat)
                        except (RuntimeError, ValueError) as exc:
                            rec[label] = None
                            print(f"  {label}: {str(exc).splitlines()[0][:80]}")
                ours = [v for k, v in rec.items() if k in (
                    "rows", "rows_deg", "warp", "warp_deg", "deg_cols", "deg_cols_cf1", "deg_cols_2chunks", "deg_cf2",
                    "deg_cf2_u8", "multi4", "multi16", "groups", "tensor_core") and v]
                rec["best_ours_over_cusparse"] = rec["cusparse"] / min(ours) if rec.get("cusparse") else None
                rec["old_best_over_cusparse"] = rec["cusparse"] / min(
                    v for k, v in rec.items() if k in ("rows", "groups", "tensor_core") and v)
                rows.append(rec)
                print(f"{name:>15} {dname:>8} F={f:<4} " + " ".join(
                    f"{k}={v:.4f}" for k, v in rec.items() if isinstance(v, float)), flush=True)
                del x
        del g
        torch.cuda.empty_cache()
    for key in ("best_ours_over_cusparse", "old_best_over_cusparse"):
        vals = [r[key] for r in rows if r.get(key)]
        print(f"geomean {key}: {math.exp(sum(map(math.log, vals)) / len(vals)):.3f} (min {min(vals):.3f})")
    out = Path(os.environ.get("OUT", ".")) / "rows_order_probe.json"
    out.write_text(json.dumps({"records": rows, "wall_s": time.perf_counter() - t0}, indent=1))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
