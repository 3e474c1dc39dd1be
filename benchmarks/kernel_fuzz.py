"""The differential fuzz on the GPU: >= 10,000 random cases of every public op and layer against float64
references, then a subset under ``compute-sanitizer`` (memcheck; racecheck on the kernels that use shared memory).

Cases come from `datapath.testing.fuzz` (seeded: case ``i`` of run ``--seed`` is made from the two alone).  The
main loop runs in child processes of ``--chunk`` cases each, one after another: a case that kills the CUDA
context (an illegal address) ends its child, is recorded, and the next child starts at the case after it, so
the run always finishes and reports.  The sanitizer children run with PyTorch's caching allocator off
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor its own allocation, so memcheck sees a read past a
tensor's end) on smaller graphs (``scale="cpu"``).

Run:  PYTHONPATH=src:. python benchmarks/kernel_fuzz.py [--cases 10000] [--seed 0] [--parallel 6] [--sanitizer-cases 520]
(the defaults are the committed run's: 10,000 cases in about 160 s on an H100 with 6 children, the sanitizers about 60 s)
Writes benchmarks/results/kernel_fuzz.json ({"cases", "mismatches", "sanitizer_errors", "illegal_address",
"device", "seed", "ops", per-op counts, the failures with a reproduction each, durations, versions}) and
kernel_fuzz.png (cases per op; worst error / tolerance per op); prints the table last.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, write_result
from datapath.testing.fuzz import OPS, make_case, reproduction, run_fuzz

RACE_MODES = ("plan:groups", "plan:tensor_core", "probe:groups", "probe:tensor_core")


def _races(case: Any) -> bool:
    """Cases whose kernels use shared memory: neighbor groups, tensor-core tiles, multi-head (the typed groups' too),
    sorted gathers."""
    p = case.params
    if case.op == "aggregate":
        return p.get("mode") in RACE_MODES or p.get("heads", 1) > 1
    if case.op in ("relations_into", "rgat", "hgt"):  # multi-head aggregations over the merged typed CSRs
        return p.get("heads", 1) > 1
    return case.op == "gather" and p.get("sort") is True


def child(args: argparse.Namespace) -> int:
    """Run cases ``--start``.. (``--count`` of them, or those ``--filter`` keeps) writing one JSON line each."""
    ops = tuple(args.ops.split(",")) if args.ops else None
    with open(args.jsonl, "a") as f:
        def write(res: Any) -> None:
            f.write(json.dumps(res.as_dict()) + "\n")
            f.flush()
            if res.case.index + 1 == args.abort_at:  # the harness's own test: a child dying mid-case
                os.abort()

        if args.filter == "racecheck":
            i, done = args.start, 0
            t0 = time.perf_counter()
            while done < args.count and time.perf_counter() - t0 < args.time_limit:
                case = make_case(args.seed, i, args.device, scale=args.scale, ops=ops)
                if _races(case):
                    res = run_fuzz(args.seed, 1, args.device, start=i, scale=args.scale, ops=ops)[0]
                    write(res)
                    done += 1
                    if res.status == "illegal_address":
                        return 3
                else:
                    f.write(json.dumps({"skipped": i}) + "\n")
                i += 1
            return 0
        res = run_fuzz(args.seed, args.count, args.device, start=args.start, scale=args.scale, ops=ops, on_result=write,
                       time_limit=args.time_limit)
    return 3 if res and res[-1].status == "illegal_address" else 0


def _read(jsonl: Path) -> list[dict[str, Any]]:
    if not jsonl.exists():
        return []
    out = []
    for line in jsonl.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            break
    return out


def run_phase(name: str, seed: int, count: int, chunk: int, scale: str | None, budget: float, workdir: Path,
              tool: str | None = None, filt: str | None = None, ops: str | None = None, device: str = "cuda",
              parallel: int = 1, abort_at: int = -1) -> dict[str, Any]:
    """Cases 0.. of run ``seed`` in chunks of ``chunk``, each in a child process (``parallel`` at a time; under
    ``compute-sanitizer --tool tool`` if given) until ``count`` are done or ``budget`` seconds pass.  A child
    that stops at an illegal address, or dies mid-case (that case is recorded as a crash), has the rest of its
    chunk run by a new child from the case after."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 4) // max(1, parallel))))
    prefix: list[str] = []
    if tool:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        prefix = [_sanitizer(), "--tool", tool, "--report-api-errors", "no", "--print-limit", "30"]
        if tool == "memcheck":
            prefix += ["--leak-check", "no"]
    if filt:  # a filter scans indices without bound: the children take disjoint index ranges
        queue = collections.deque((k * 1_000_000, min(chunk, count - k * chunk))
                                  for k in range(-(-count // chunk)))
    else:
        queue = collections.deque((s0, min(chunk, count - s0)) for s0 in range(0, count, chunk))
    running: dict[Any, tuple[int, int, Path, int]] = {}
    crashes: list[dict[str, Any]] = []
    files: list[Path] = []
    sanitizer_errors, logs, launched = 0, [], 0
    while queue or running:
        left = budget - (time.perf_counter() - t0)
        while queue and len(running) < parallel and left > 5:
            start, n = queue.popleft()
            jsonl = workdir / f"{name}_{launched}.jsonl"
            launched += 1
            files.append(jsonl)
            cmd = prefix + [sys.executable, str(Path(__file__).resolve()), "--child", "--seed", str(seed),
                            "--start", str(start), "--count", str(n), "--jsonl", str(jsonl),
                            "--time-limit", str(max(5.0, left - 10)), "--device", device]
            cmd += ["--scale", scale] if scale else []
            cmd += ["--filter", filt] if filt else []
            cmd += ["--ops", ops] if ops else []
            cmd += ["--abort-at", str(abort_at)] if abort_at >= 0 else []
            log = open(workdir / f"{jsonl.stem}.log", "w")
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            running[proc] = (start, n, jsonl, time.perf_counter())
        if not running:
            break
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None or time.perf_counter() - t0 > budget + 60]:
            start, n, jsonl, _ = running.pop(proc)
            if proc.poll() is None:  # far past its time limit: stop it
                proc.kill()
                proc.wait()
            rc = proc.returncode
            text = (workdir / f"{jsonl.stem}.log").read_text(errors="replace")
            rows = _read(jsonl)
            if tool:
                found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
                errs = sum(int(v) for v in found)
                sanitizer_errors += errs
                if errs or not found:
                    logs.append(text[-6000:])
            last = max([r["case"]["index"] for r in rows if "case" in r] + [r["skipped"] for r in rows if "skipped" in r]
                       + [start - 1])
            done = sum(1 for r in rows if "case" in r)
            if rc not in (0, 3):  # the child died mid-case (an abort, a kill): that case is a crash
                crashes.append({"index": last + 1, "rc": rc, "tail": text[-3000:],
                                "reproduction": reproduction(make_case(seed, last + 1, device, scale=scale))})
                logs.append(text[-6000:])
                last, done = last + 1, done + 1
            if done < n and rc != 0 and time.perf_counter() - t0 < budget - 5:  # rc 0 short: out of time
                queue.appendleft((last + 1, n - done))
    results = [r for f in files for r in _read(f) if "case" in r]
    results.sort(key=lambda r: r["case"]["index"])
    return {"name": name, "tool": tool, "results": results, "crashes": crashes, "sanitizer_errors": sanitizer_errors,
            "seconds": time.perf_counter() - t0, "logs": logs, "children": launched}


def _sanitizer() -> str:
    for cand in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                 *sorted(str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))):
        if cand and Path(cand).exists():
            return cand
    raise FileNotFoundError("compute-sanitizer not found (PATH, /usr/local/cuda*/bin)")


def _summary(phase: dict[str, Any]) -> dict[str, Any]:
    res = phase["results"]
    per_op: dict[str, dict[str, Any]] = {}
    for r in res:
        op = r["case"]["op"]
        d = per_op.setdefault(op, {"cases": 0, "ok": 0, "mismatches": 0, "errors": 0, "unclear_errors": 0,
                                   "illegal_address": 0, "worst_ratio": 0.0, "seconds": 0.0})
        d["cases"] += 1
        key = {"ok": "ok", "mismatch": "mismatches", "error": "errors", "unclear_error": "unclear_errors",
               "illegal_address": "illegal_address"}[r["status"]]
        d[key] += 1
        w = r["worst"]
        d["worst_ratio"] = "inf" if w == "inf" or d["worst_ratio"] == "inf" else max(d["worst_ratio"], w)
        d["seconds"] += r["seconds"]
    status = collections.Counter(r["status"] for r in res)
    unrepresentable = sum(1 for r in res for c in r["checks"] if c[1] == "unrepresentable")
    reuse = collections.Counter(k for r in res for k in r.get("reused", []))
    return {"cases": len(res) + len(phase["crashes"]), "mismatches": status["mismatch"], "errors": status["error"],
            "unclear_errors": status["unclear_error"],
            "illegal_address": status["illegal_address"] + len(phase["crashes"]), "crashes": phase["crashes"],
            "sanitizer_errors": phase["sanitizer_errors"], "seconds": round(phase["seconds"], 1), "per_op": per_op,
            "graphs_at_reused_addresses": dict(reuse),
            "unrepresentable_checks": unrepresentable,
            "failures": [{"index": r["case"]["index"], "op": r["case"]["op"], "status": r["status"],
                          "worst": r["worst"], "checks": [c for c in r["checks"] if _over(c[1])],
                          "message": r["message"][:400], "reproduction": reproduction_of(r)}
                         for r in res if r["status"] != "ok"][:400]}


def _over(v: Any) -> bool:
    """A check's ratio over its tolerance (``"inf"``: non-finite or misshapen; ``"unrepresentable"``: not graded)."""
    return v == "inf" or (not isinstance(v, str) and v > 1)


def reproduction_of(row: dict[str, Any]) -> str:
    from datapath.testing.fuzz import FuzzCase  # noqa: PLC0415

    return reproduction(FuzzCase.from_dict(row["case"]))


def _coverage(res: list[dict[str, Any]]) -> dict[str, Any]:
    cnt: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in res:
        p = r["case"]["params"]
        for k in ("graph", "dtype", "mode", "reduce", "table", "path", "launcher", "probe", "scenario", "form", "kind",
                  "decomp"):
            if k in p:
                cnt[k][str(p[k]) if k != "mode" else str(p[k]).split(":")[-1] if ":" in str(p[k]) else "default"] += 1
        for k in ("width", "in", "out"):
            if k in p:
                cnt["widths"]["odd" if p[k] % 2 else "even"] += 1
                cnt["width_max"]["max"] = max(cnt["width_max"]["max"], p[k])
    return {k: dict(v) for k, v in cnt.items()}


def plot(per_op: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = sorted(per_op)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.bar(ops, [per_op[o]["cases"] for o in ops], color="tab:blue")
    a.bar(ops, [per_op[o]["cases"] - per_op[o]["ok"] for o in ops], color="tab:red", label="not ok")
    a.set_title("cases per op (red: mismatches, errors, crashes)")
    a.tick_params(axis="x", rotation=60)
    a.legend()
    worst = [1e3 if per_op[o]["worst_ratio"] == "inf" else max(per_op[o]["worst_ratio"], 1e-6) for o in ops]
    b.bar(ops, worst, color=["tab:red" if w > 1 else "tab:green" for w in worst])
    b.axhline(1.0, color="k", lw=1, ls="--")
    b.set_yscale("log")
    b.set_title("worst |error| / tolerance per op (<= 1 passes; 1e3: non-finite)")
    b.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=1_000, help="cases per child process of the main loop")
    ap.add_argument("--parallel", type=int, default=6, help="child processes at a time (one GPU, the CPU references)")
    ap.add_argument("--time-budget", type=float, default=290.0, help="seconds for the main loop")
    ap.add_argument("--sanitizer-cases", type=int, default=520)
    ap.add_argument("--sanitizer-budget", type=float, default=125.0)
    ap.add_argument("--racecheck-cases", type=int, default=48)
    ap.add_argument("--racecheck-budget", type=float, default=60.0)
    ap.add_argument("--ops", default="", help="comma-separated ops (default: every op)")
    ap.add_argument("--name", default="kernel_fuzz")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the harness (no sanitizer)")
    # child mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", default="", help=argparse.SUPPRESS)
    ap.add_argument("--scale", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--filter", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, default=1e9, help=argparse.SUPPRESS)
    ap.add_argument("--abort-at", type=int, default=-1, help="(testing the harness) a child aborts at this case")
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kernel_fuzz needs a CUDA GPU (tests/fuzz runs the CPU cases; --device cpu tries the harness)")
        return 2
    ops = args.ops or None
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kernel_fuzz_"))
    main_phase = run_phase("main", args.seed, args.cases, args.chunk, None, args.time_budget, work, ops=ops,
                           device=args.device, parallel=args.parallel, abort_at=args.abort_at)
    phases = {"main": _summary(main_phase)}
    print(f"main: {phases['main']['cases']} cases in {main_phase['seconds']:.0f} s; graphs whose id / indptr / "
          f"indices address an earlier case's had: {phases['main']['graphs_at_reused_addresses']}", flush=True)
    for name, tool, n, budget, filt in (("memcheck", "memcheck", args.sanitizer_cases, args.sanitizer_budget, None),
                                        ("racecheck", "racecheck", args.racecheck_cases, args.racecheck_budget,
                                         "racecheck")):
        if n <= 0 or args.device != "cuda":
            continue
        try:
            ph = run_phase(name, args.seed + 1, n, -(-n // args.parallel), "cpu", budget, work, tool=tool, filt=filt,
                           ops=ops, parallel=args.parallel)
        except FileNotFoundError as exc:
            print(f"{name}: {exc}")
            phases[name] = {"cases": 0, "error": str(exc)}
            continue
        phases[name] = _summary(ph)
        phases[name]["logs"] = [t[-3000:] for t in ph["logs"][:3]]
        print(f"{name}: {phases[name]['cases']} cases, {ph['sanitizer_errors']} sanitizer errors in "
              f"{ph['seconds']:.0f} s", flush=True)
    m = phases["main"]
    san = [phases[k] for k in ("memcheck", "racecheck") if k in phases]
    payload = {
        "cases": m["cases"], "mismatches": m["mismatches"] + sum(p.get("mismatches", 0) for p in san),
        "errors": m["errors"] + sum(p.get("errors", 0) for p in san),
        "unclear_errors": m["unclear_errors"] + sum(p.get("unclear_errors", 0) for p in san),
        "sanitizer_errors": sum(p.get("sanitizer_errors", 0) for p in san),
        "illegal_address": m["illegal_address"] + sum(p.get("illegal_address", 0) for p in san),
        "sanitizer_cases": {k: phases[k]["cases"] for k in ("memcheck", "racecheck") if k in phases},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "seed": args.seed, "sanitizer_seed": args.seed + 1,
        "ops": sorted(m["per_op"]), "ops_drawn_from": list(OPS), "per_op": m["per_op"],
        "coverage": _coverage(main_phase["results"]), "phases": phases,
        "durations_s": {"total": round(time.perf_counter() - t0, 1),
                        **{k: v.get("seconds", 0) for k, v in phases.items()}},
        "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    path = write_result(args.name, payload)
    plot(m["per_op"], RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    for ph_name, ph in phases.items():
        for f in ph.get("failures", [])[:15]:
            print(f"[{ph_name}] case {f['index']} {f['op']} {f['status']} {f['checks']} {f['message'][:300]}\n"
                  f"    repro: python -c \"{f['reproduction']}\"")
    rows = [{"op": op, **{k: d[k] for k in ("cases", "mismatches", "errors", "unclear_errors", "illegal_address",
                                           "worst_ratio", "seconds")}} for op, d in sorted(m["per_op"].items())]
    rows.append({"op": "TOTAL", "cases": payload["cases"], "mismatches": payload["mismatches"],
                 "errors": payload["errors"], "unclear_errors": payload["unclear_errors"],
                 "illegal_address": payload["illegal_address"], "worst_ratio": "",
                 "seconds": payload["durations_s"]["total"]})
    print(f"sanitizer: {payload['sanitizer_cases']} cases, {payload['sanitizer_errors']} errors")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
