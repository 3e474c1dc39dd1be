"""B5's command line: every option of `benchmarks/multi_node.py` (its ``--help``), defaults filled in."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def parse(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """B5's command line (`benchmarks/multi_node.py --help`: ``description`` is its docstring), defaults filled in."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 epochs of 12 steps (a smoke test)")
    p.add_argument("--datasets", default="products,papers")
    p.add_argument("--papers-gb", type=float, default=4.0, help="host memory of the papers-shaped graph [4]")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes, one GPU each [2]")
    p.add_argument("--batch-size", type=int, default=None,
                   help="the 1-GPU batch (the global batch of the strong run: a multiple of --nodes) [1024; 256 "
                        "with --quick]")
    p.add_argument("--prefetch", type=int, default=2, help="batches each loader stage prepares ahead [2]")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-batches", type=int, default=None, help="steps per epoch at most [all]")
    p.add_argument("--eval-nodes", type=int, default=10_000)
    p.add_argument("--modes", default="strong,weak")
    p.add_argument("--caches", default="none",
                   help="GPU caches of the N-node strong runs, comma-separated: none, or SCOPE:SIZE (any:25%%: the "
                        "hottest rows of any shard, remote ones included; own:50%%: of the node's own shard, served "
                        "from its GPU) [none]; the weak run uses the first")
    p.add_argument("--model", type=Path, default=None, metavar="JSON",
                   help="print the bytes-vs-link model of docs/multi_node.md from this result's records and exit")
    p.add_argument("--fixed-share", type=float, default=None,
                   help="--model: the share of a step that does not shrink with the batch [from the strong run]")
    p.add_argument("--fixed-ms", type=float, default=None,
                   help="--model: the exchange's fixed cost per batch in ms [from the strong run]")
    p.add_argument("--graph-on", default=None, help="graph placement of every run [unified on GPUs]")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "datapath-multi-node",
                   help="where the datasets are prepared (kept for the next run) [$TMPDIR/datapath-multi-node]")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--repeat", type=int, default=1,
                   help="make each N-node run this many times (how often a run hangs: failed_runs) [1]")
    p.add_argument("--name", default=None, help="result name [multi_node; multi_node_quick with --quick]")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="only merge the records of these result files (e.g. the products and papers calls of "
                        "scripts/gpu_check.sh --suite b5 / b5-papers) into results/<name>.json and its plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.nodes < 2:
        p.error(f"--nodes must be at least 2, got {args.nodes}")
    if args.quick:
        args.datasets, args.epochs, args.hidden = "tiny", 2, 64
        args.fanouts, args.eval_nodes, args.max_batches = "10,5", 2000, args.max_batches or 12
    args.batch_size = args.batch_size or (256 if args.quick else 1024)
    if args.batch_size < 1:
        p.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if not (args.worker or args.merge or args.model) and "strong" in args.modes.split(","):
        problem = strong_batch_problem(args.batch_size, args.nodes)
        if problem:
            p.error(problem)
    args.name = args.name or ("multi_node_quick" if args.quick else "multi_node")
    args.graph_on = args.graph_on or ("unified" if args.device == "cuda" else "cpu")
    return args


def strong_batch_problem(batch: int, nodes: int) -> str | None:
    """Why the 1-GPU batch ``batch`` cannot be the strong run's global batch over ``nodes`` nodes (None: it can).

    The strong run gives every node ``batch / nodes`` seeds a step (a rank's batch is the same on every rank), so
    that the global batch, the steps and the learning curve are the 1-GPU run's exactly: ``batch`` must be a
    multiple of ``nodes``.
    """
    if batch % nodes == 0:
        return None
    lo, hi = batch // nodes * nodes, -(-batch // nodes) * nodes
    multiples = f"{lo} or {hi}" if lo else f"{hi}"
    divisors = [d for d in range(2, min(batch, 64) + 1) if batch % d == 0]
    other = f", --nodes {', '.join(map(str, divisors))} (they divide {batch})" if divisors else ""
    return (f"--batch-size {batch} does not split evenly over --nodes {nodes}: the strong run gives every node the "
            f"same share of the 1-GPU batch, so that the global batch is the 1-GPU batch exactly; give --batch-size "
            f"{multiples} (multiples of {nodes}){other}, or --modes weak")


def per_rank_batch(args: argparse.Namespace, mode: str) -> int:
    """Seeds per rank and step of an N-node run: ``strong``, the 1-GPU batch cut over the nodes (global batch =
    ``--batch-size`` exactly; `parse` refuses one that does not divide); ``weak``, the 1-GPU batch on every node."""
    if mode == "weak":
        return args.batch_size
    problem = strong_batch_problem(args.batch_size, args.nodes)
    if problem:
        raise ValueError(problem)
    return args.batch_size // args.nodes
