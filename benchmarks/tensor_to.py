"""What ``import datapath`` costs every ``Tensor.to`` call: the patch that makes ``t.to("unified")`` work.

Each call form is timed in two fresh interpreters, one with plain torch and one after
``import datapath`` (the patch cannot be undone in a process), on the same 100-element
CPU tensor, as the minimum over repeats of the mean of many calls.  The overhead is the
difference.  Bar (issue 13): < 0.5 us per call on non-unified targets.

    python benchmarks/tensor_to.py [--calls 200000] [--repeats 15]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS_DIR, print_table, write_result  # noqa: E402

FORMS = {
    "dtype positional": "t.to(torch.float64)",
    "same dtype (no-op)": "t.to(torch.float32)",
    "device string": "t.to('cpu')",
    "torch.device": "t.to(cpu)",
    "dtype keyword": "t.to(dtype=torch.float64)",
    "device + dtype": "t.to('cpu', torch.float64)",
    "other tensor": "t.to(other)",
}
BAR_US = 0.5

_CHILD = r"""
import json, sys, timeit, torch
if sys.argv[1] == "1":
    import datapath  # noqa: F401 - installs the Tensor.to patch
t = torch.randn(100)
cpu, other = torch.device("cpu"), torch.zeros(3, dtype=torch.float64)
forms, calls, repeats = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {}
for name, stmt in forms.items():
    times = timeit.repeat(stmt, globals={"t": t, "torch": torch, "cpu": cpu, "other": other},
                          number=calls, repeat=repeats)
    out[name] = min(times) / calls * 1e6
print(json.dumps(out))
"""


def _measure(patched: bool, calls: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DATAPATH_UNIFIED_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, "1" if patched else "0", json.dumps(FORMS), str(calls),
                           str(repeats)], capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per timing [200000]")
    ap.add_argument("--repeats", type=int, default=15, help="timings per form; the minimum counts [15]")
    ap.add_argument("--rounds", type=int, default=3, help="plain/patched interpreter pairs, alternating [3]")
    args = ap.parse_args()
    plain: dict[str, list[float]] = {k: [] for k in FORMS}
    patched: dict[str, list[float]] = {k: [] for k in FORMS}
    for _ in range(args.rounds):
        for name, v in _measure(False, args.calls, args.repeats).items():
            plain[name].append(v)
        for name, v in _measure(True, args.calls, args.repeats).items():
            patched[name].append(v)
    records = []
    for name, stmt in FORMS.items():
        p, q = min(plain[name]), min(patched[name])
        records.append({"form": name, "call": stmt, "plain_us": p, "patched_us": q, "overhead_us": q - p,
                        "under_bar": q - p < BAR_US})
    worst = max(r["overhead_us"] for r in records)
    write_result("tensor_to", {"records": records, "bar_us": BAR_US, "worst_overhead_us": worst,
                               "calls": args.calls, "repeats": args.repeats, "rounds": args.rounds})
    _plot(records)
    print_table(records, ["form", "plain_us", "patched_us", "overhead_us", "under_bar"])
    print(f"worst overhead {worst:.3f} us per call (bar {BAR_US} us): {'met' if worst < BAR_US else 'NOT met'}")


def _plot(records: list[dict]) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return
    names = [r["form"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    y = range(len(records))
    ax.barh([i + 0.2 for i in y], [r["plain_us"] for r in records], height=0.4, label="torch alone")
    ax.barh([i - 0.2 for i in y], [r["patched_us"] for r in records], height=0.4, label="after import datapath")
    ax.set_yticks(list(y), names)
    ax.set_xlabel("us per Tensor.to call (100-element CPU tensor)")
    ax.set_title("Cost of datapath's Tensor.to patch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "tensor_to.png", dpi=120)


if __name__ == "__main__":
    main()
