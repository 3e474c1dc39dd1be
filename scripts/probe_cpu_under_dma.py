"""Does the CPU launch PyTorch ops more slowly while the GPU streams host memory over PCIe?

The B2 loader's producer thread does the same Python work in the datapath and gpu_resident
ways, yet measured ~1.2-1.5x more CPU time per batch in the datapath way, where the GPU reads
features and the graph from pinned host memory.  This times a fixed CPU workload:

- ``torch_ops``: small CUDA ops launched from Python (what the loader's producer does);
- ``python``: pure interpreter work (dict/list churn, no CUDA);
- ``memcpy``: a 64 MiB host-to-host copy (host memory bandwidth);

while the GPU, on another stream, is (a) idle, (b) copying pinned host memory to the GPU with
the copy engine, (c) reading pinned host memory with the zero-copy gather kernel (the
datapath way), (d) copying within GPU memory (busy, no PCIe).  Prints one row per state.

Run on the GPU machine: PYTHONPATH=src python scripts/probe_cpu_under_dma.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def torch_ops(n: int = 300) -> None:
    x = torch.arange(4096, device="cuda")
    for _ in range(n):
        y = torch.cumsum(x, 0)
        z = (y[1:] - y[:-1]).clamp(min=1)
        torch.where(z > 3, z, x[:-1])


def python_work(n: int = 20000) -> None:
    d: dict[int, list[int]] = {}
    for i in range(n):
        d.setdefault(i % 97, []).append(i * 3)
    sum(len(v) for v in d.values())


_SRC = None
_DST = None


def memcpy_work() -> None:
    global _SRC, _DST
    if _SRC is None:
        _SRC = torch.randn(16 << 20)
        _DST = torch.empty_like(_SRC)
    _DST.copy_(_SRC)


WORK = {"torch_ops": torch_ops, "python": python_work, "memcpy": memcpy_work}


def time_work(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from datapath.unified_tensor import ErrorFlag, as_unified, gather

    side = torch.cuda.Stream()
    host = torch.randn(4 << 28 >> 2).pin_memory()  # 1 GiB pinned
    dev_buf = torch.empty_like(host, device="cuda")
    table = as_unified(torch.randn(4 << 20, 100))  # 1.6 GB table, rows of 400 B (products' width)
    idx = torch.randint(0, table.shape[0], (4 << 20,), device="cuda")
    d2d_src = torch.randn(1 << 28, device="cuda")
    d2d_dst = torch.empty_like(d2d_src)

    flag = ErrorFlag()  # the background gathers must not wait for their bounds check

    def background(state: str) -> None:
        reps = {"h2d_copy": 80, "zero_copy_gather": 60, "d2d_copy": 2000}[state]
        with torch.cuda.stream(side):
            for _ in range(reps):
                if state == "h2d_copy":
                    dev_buf.copy_(host, non_blocking=True)
                elif state == "zero_copy_gather":
                    gather(table, idx, error_flag=flag)
                elif state == "d2d_copy":
                    d2d_dst.copy_(d2d_src)

    for fn in WORK.values():  # warm up (kernel compile, allocator)
        fn()
    rows = []
    for state in ("idle", "h2d_copy", "zero_copy_gather", "d2d_copy", "idle"):
        torch.cuda.synchronize()
        if state != "idle":
            background(state)
            time.sleep(0.05)
        row = {"gpu_state": state}
        for name, fn in WORK.items():
            row[f"{name}_ms"] = time_work(fn, args.reps)
        row["background_still_running"] = not side.query()
        rows.append(row)
        side.synchronize()
        print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_cpu_under_dma.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
