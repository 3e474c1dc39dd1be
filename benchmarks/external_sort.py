"""An edge list several times larger than the memory budget turned into a CSR by ``prepare-dataset --from``.

For each size: a synthetic (2, E) int64 edge list (``.npy``, the layout of OGB's ``edge_index``)
is written to disk and dropped from the page cache; ``datapath prepare-dataset --from npz`` then
runs in a child process with ``--memory BUDGET``, which reports its own peak resident memory
(``VmHWM``: the whole process, interpreter and torch included).  The rate is
compared with the disk's sequential bandwidth (``dd`` with O_DIRECT) and the bytes the sort
moves per edge.  The CSR is checked (in-degrees against a count of the input, the sum of the
sources).  With ``--features-dim F`` (default 32) float32 node features and labels are converted
too (a dataset directory: the features stream through in blocks) and compared with the input.  CPU only.

    python benchmarks/external_sort.py                       # 50M and 200M edges (+ 32 features a node) at 400MB
    python benchmarks/external_sort.py --edges 20e6 --memory 300MB
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import print_table, write_result
from datapath.features import parse_budget
from datapath.graph.npy_stream import NpyReader, NpyWriter

_CHUNK = 1 << 24


def write_edges(path: Path, num_edges: int, num_nodes: int, seed: int) -> None:
    """A (2, E) int64 edge list: sources uniform, destinations skewed (a power law over the ids)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (2, num_edges)})
        for row in (0, 1):
            for i in range(0, num_edges, _CHUNK):
                rng = np.random.default_rng([seed, row, i])
                k = min(_CHUNK, num_edges - i)
                ids = rng.integers(0, num_nodes, k) if row == 0 else \
                    (num_nodes * rng.power(0.6, k)).astype(np.int64).clip(0, num_nodes - 1)
                f.write(ids.astype("<i8").data)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(d: Path, mib: int = 2048) -> dict[str, float]:
    """Sequential write and read of ``mib`` MiB with O_DIRECT (dd), bytes per second."""
    f = d / "dd.bin"
    out = {}
    for name, args in (("write", [f"of={f}", "if=/dev/zero", "oflag=direct"]),
                       ("read", [f"if={f}", "of=/dev/null", "iflag=direct"])):
        r = subprocess.run(["dd", *args, "bs=16M", f"count={mib // 16}"], capture_output=True, text=True,
                           check=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
        out[f"{name}_bytes_per_s"] = int(m.group(1)) / float(m.group(2))
    f.unlink()
    return out


# VmHWM, the peak resident memory of this process image: ru_maxrss would also count the parent's resident memory
# at the fork before exec (Linux keeps the larger of the two across exec)
_CHILD = ("import re, sys\n"
          "from datapath.cli import main\n"
          "import datapath.apps.prepare, datapath.graph\n"
          "rss = lambda key: re.search(key + r':\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
          "print('start_rss_kib', rss('VmRSS'), flush=True)\n"
          "rc = main(sys.argv[1:])\n"
          "print('peak_rss_kib', rss('VmHWM'), flush=True)\n"
          "sys.exit(rc)\n")


def run_child(args: list[str], log: Path) -> tuple[float, int, int, str]:
    """Wall seconds, resident memory after the imports and at its peak (bytes: the child's own VmRSS, VmHWM)
    and output of ``datapath ARGS``."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-c", _CHILD, *args], stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = log.read_text()
    m, m0 = re.search(r"peak_rss_kib (\d+)", text), re.search(r"start_rss_kib (\d+)\n", text)
    if rc != 0 or m is None or m0 is None:
        raise RuntimeError(f"prepare-dataset failed: {text.strip()}")
    return wall, int(m0.group(1)) * 1024, int(m.group(1)) * 1024, text[m0.end():m.start()]


def write_nodes(d: Path, num_nodes: int, width: int, seed: int) -> None:
    """``x.npy`` (N, width) float32 normal features and ``y.npy`` (N,) labels in [0, 16)."""
    rng = np.random.default_rng([seed, 7])
    with NpyWriter(d / "x.npy", (num_nodes, width), np.float32) as w:
        for i in range(0, num_nodes, 1 << 20):
            w.write(rng.standard_normal((min(1 << 20, num_nodes - i), width), dtype=np.float32))
    with NpyWriter(d / "y.npy", (num_nodes,), np.int64) as w:
        for i in range(0, num_nodes, 1 << 22):
            w.write(rng.integers(0, 16, min(1 << 22, num_nodes - i)))


def check_features(src: Path, out: Path) -> bool:
    """The written features equal the input's, compared a block at a time."""
    a, b = NpyReader(src).rows(1 << 18), NpyReader(out).rows(1 << 18)
    return all(np.array_equal(x, y) for x, y in zip(a, b)) and next(a, None) is None and next(b, None) is None


def check_csr(edges: Path, out: Path, num_nodes: int, num_edges: int) -> bool:
    """In-degrees equal a count of the input's destinations; the sources sum to the input's."""
    r = NpyReader(edges)
    deg = np.zeros(num_nodes, np.int64)
    src_sum = 0
    for s in r.rows(_CHUNK, 0, num_edges):
        src_sum += int(s.sum())
    for d in r.rows(_CHUNK, num_edges * 8, num_edges):
        deg += np.bincount(d, minlength=num_nodes)
    indptr = np.load(out / "indptr.npy", mmap_mode="r")
    idx_sum = sum(int(c.sum(dtype=np.int64)) for c in NpyReader(out / "indices.npy").rows(_CHUNK))
    return bool(np.array_equal(np.diff(indptr), deg) and idx_sum == src_sum and indptr[-1] == num_edges)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", type=float, nargs="+", default=[50e6, 200e6])
    ap.add_argument("--memory", default="400MB", help="--memory of prepare-dataset [400MB]")
    ap.add_argument("--avg-degree", type=float, default=15.0, help="edges per node (ogbn-papers100M: 14.5) [15]")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder on the disk to measure [a temp dir]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--features-dim", type=int, default=32,
                    help="also convert float32 node features of this width and labels (0: the graph only) [32]")
    args = ap.parse_args()
    budget = int(parse_budget(args.memory, 1 << 40, "--memory"))
    scratch = Path(tempfile.mkdtemp(prefix="extsort-", dir=args.dir))
    try:
        disk = disk_bandwidth(scratch)
        rows = []
        for e in args.edges:
            e = int(e)
            n = max(2, int(e / args.avg_degree))
            edges, out = scratch / "edges.npy", scratch / "csr"
            t0 = time.perf_counter()
            write_edges(edges, e, n, args.seed)
            node_args: list[str] = []
            if args.features_dim:
                write_nodes(scratch, n, args.features_dim, args.seed)
                node_args = ["--features", str(scratch / "x.npy"), "--labels", str(scratch / "y.npy")]
            gen_s = time.perf_counter() - t0
            for f in scratch.glob("*.npy"):
                drop_cache(f)
            load0 = os.getloadavg()[0]
            wall, rss0, rss, text = run_child(["prepare-dataset", "--from", "npz", str(edges), str(out), "--memory",
                                         args.memory, "--num-nodes", str(n), "--no-progress", *node_args],
                                        scratch / "log")
            conv = re.search(r"\(([\d.]+) s\)", text)
            convert_s = float(conv.group(1)) if conv else wall
            ok = check_csr(edges, out, n, e)
            feats_ok = check_features(scratch / "x.npy", out / "features.npy") if args.features_dim else None
            sort = json.loads((out / "meta.json").read_text())["sort"] if args.features_dim else None
            sort_s = sort["run_s"] + sort["merge_s"] if sort else convert_s
            input_bytes = edges.stat().st_size
            feature_bytes = (scratch / "x.npy").stat().st_size if args.features_dim else 0
            idx_bytes = 4 if n < 2**31 else 8
            # bytes the sort reads and writes per edge: input 16, runs written and read back 2 x 8 (int32 pairs),
            # indices written 4 (+ indptr 8 per node)
            moved = 16 + 16 + idx_bytes + 8 / args.avg_degree
            rows.append({
                "edges": e, "nodes": n, "input_bytes": input_bytes, "budget_bytes": budget,
                "input_over_budget": input_bytes / budget, "peak_rss_bytes": rss, "rss_over_budget": rss / budget,
                "rss_after_imports_bytes": rss0, "load_average_before_after": [load0, os.getloadavg()[0]],
                "feature_bytes": feature_bytes, "features_checked": feats_ok,
                "wall_s": wall, "convert_s": convert_s, "sort_s": sort_s, "edges_per_s": e / sort_s,
                "input_bytes_per_s": input_bytes / sort_s,
                "features_bytes_per_s": feature_bytes / (convert_s - sort_s) if feature_bytes else None,
                "bytes_moved_per_edge": moved,
                "disk_bound_edges_per_s": min(disk["read_bytes_per_s"], disk["write_bytes_per_s"]) / moved,
                "csr_checked": ok, "generate_s": gen_s,
                "output": text.strip()})
            shutil.rmtree(out)
            for f in scratch.glob("*.npy"):
                f.unlink()
        print(f"disk (dd, O_DIRECT, 16 MiB blocks): write {disk['write_bytes_per_s'] / 1e9:.2f} GB/s, "
              f"read {disk['read_bytes_per_s'] / 1e9:.2f} GB/s; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        print_table([{"edges": f"{r['edges'] / 1e6:.0f}M", "input": f"{r['input_bytes'] / 1e9:.2f} GB",
                      "features": f"{r['feature_bytes'] / 1e9:.2f} GB",
                      "budget": f"{budget / 1e6:.0f} MB", "x budget": r["input_over_budget"],
                      "RSS imports": f"{r['rss_after_imports_bytes'] / 1e6:.0f} MB",
                      "peak RSS": f"{r['peak_rss_bytes'] / 1e6:.0f} MB", "RSS/budget": r["rss_over_budget"],
                      "process s": r["wall_s"], "convert s": r["convert_s"], "sort s": r["sort_s"],
                      "Medges/s": r["edges_per_s"] / 1e6,
                      "disk-bound Medges/s": r["disk_bound_edges_per_s"] / 1e6, "CSR ok": r["csr_checked"],
                      "features ok": r["features_checked"]}
                     for r in rows])
        path = write_result("external_sort", {"budget": args.memory, "budget_bytes": budget, "disk": disk,
                                              "cpus": os.cpu_count(), "rows": rows})
        print(f"wrote {path}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
