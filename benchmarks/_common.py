"""Helpers shared by the benchmark scripts: result files, tables, timing."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from datapath.apps import machine_info

RESULTS_DIR = Path(os.environ.get("DATAPATH_RESULTS", Path(__file__).resolve().parent / "results"))


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``results/<name>.json`` with the machine description and the command line added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine_info(),
        **payload,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print ``rows`` (dicts) as an aligned text table."""
    if not rows:
        print("(no rows)")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 3, repeat: int = 10) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events (synchronising around)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
