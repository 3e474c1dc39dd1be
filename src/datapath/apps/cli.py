"""``datapath train-gnn`` (the main job) and ``datapath prepare-dataset``: argument parsing only.

The work is `datapath.apps.train_gnn.run_training` and `datapath.graph.prepare_dataset`;
every argument is checked (types, ranges, output paths) before any of it starts.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _fanouts(text: str) -> tuple[int, ...]:
    """``"15,10,5"`` -> (15, 10, 5); argparse turns the ValueError into one clear line."""
    try:
        out = tuple(int(f) for f in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 15,10,5, got {text!r}") from None
    if any(f == 0 or f < -1 for f in out):
        raise argparse.ArgumentTypeError(f"each fanout must be a positive integer (or -1 for all), got {text!r}")
    return out


def _positive(kind: type, minimum: float = 1) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def _budget(flag: str) -> Any:
    """An argparse type checking that a budget (``25%``, ``16GB``) parses; the text is kept."""
    def parse(text: str) -> str:
        from datapath.features import FeatureStoreError, parse_budget  # noqa: PLC0415

        try:
            parse_budget(text, 1 << 40, flag)
        except FeatureStoreError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    parse.__name__ = "size"
    return parse


def register(sub: Any) -> None:
    p = sub.add_parser(
        "train-gnn",
        help="train GraphSAGE or GAT with GPU neighbor sampling and zero-copy feature loading",
        description="Mini-batch GNN node classification. With no arguments: GraphSAGE on the built-in "
                    "'tiny' dataset (generated in a second), on the GPU when there is one, else the CPU.",
    )
    p.add_argument("--dataset", default="tiny",
                   help="preset (tiny, reddit, products, papers) or a directory from prepare-dataset [tiny]")
    p.add_argument("--model", choices=("sage", "gat", "rgat", "rgcn", "hgt"), default="sage",
                   help="GNN; rgat/rgcn/hgt: relational models on a heterogeneous dataset (igbh-tiny, igbh-small, mag) "
                        "[sage]")
    p.add_argument("--epochs", type=_positive(int, 0), default=4, help="epochs [4]")
    p.add_argument("--batch-size", type=_positive(int), default=512, help="seed nodes per batch (per GPU) [512]")
    p.add_argument("--fanouts", type=_fanouts, default=(10, 5),
                   help="neighbours per hop, seeds first; one layer per hop [10,5]")
    p.add_argument("--hidden", type=_positive(int), default=128, help="hidden width [128]")
    p.add_argument("--heads", type=_positive(int), default=4, help="GAT attention heads [4]")
    p.add_argument("--dropout", type=float, default=0.3, help="dropout [0.3]")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate [3e-3]")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer [adam]")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="where to train [cuda if available]")
    p.add_argument("--features-on", choices=("unified", "cuda", "cpu"), default=None,
                   help="where node features and labels live: unified (pinned host memory read by the GPU, "
                        "zero copy), cuda (GPU memory), cpu (pageable; CPU gather + copy) [unified]")
    p.add_argument("--graph-on", choices=("unified", "cuda", "cpu", "auto"), default=None,
                   help="where the graph lives; unified/cuda sample on the GPU, cpu on the CPU; auto (with "
                        "--gpu-cache/--host-memory): on the GPU when it fits beside the cache [as --features-on; "
                        "auto with a feature store]")
    p.add_argument("--gpu-cache", type=_budget("--gpu-cache"), default=None, metavar="SIZE",
                   help="serve the features from a tiered feature store whose GPU cache holds the hottest rows in "
                        "SIZE of GPU memory: a share of the feature bytes ('25%%') or a size ('10GB', '4GiB')")
    p.add_argument("--host-memory", type=_budget("--host-memory"), default=None, metavar="SIZE",
                   help="pinned host memory for the feature rows of a dataset directory ('16GB', '25%%'); rows "
                        "beyond it are read from its features.npy on disk (O_DIRECT) [all of them when they fit]")
    p.add_argument("--disk-superbatch", type=_budget("--disk-superbatch"), default=None, metavar="SIZE",
                   help="with --host-memory: that much of it ('20%%' of the features, '8GB') stages the disk rows "
                        "of many batches at once, read as only their pages or one sequential O_DIRECT scan, "
                        "whichever the disk's measured costs make faster [off: each batch reads its own rows]")
    p.add_argument("--cache-policy", choices=("presample", "degree"), default="presample",
                   help="which rows the GPU cache and host memory hold: the ones a presampling pass of the "
                        "sampler reads most (GNNLab), or the highest-degree nodes [presample]")
    p.add_argument("--shard-features", action="store_true",
                   help="cut the features over the job's ranks (on one or many machines, e.g. torchrun --nnodes N "
                        "--nproc-per-node G): each rank loads the graph, labels and splits but only its shard of "
                        "the features from the dataset directory (its shard file of prepare-dataset --shards N, or "
                        "its rows of features.npy), holds it in pinned host memory and fetches the other ranks' rows "
                        "from them (all_to_all over NCCL, gloo on CPUs); --gpu-cache adds a cache of hot rows of "
                        "any shard. No shared memory segment")
    p.add_argument("--cache-scope", choices=("any", "own"), default="any",
                   help="with --shard-features and --gpu-cache: cache the hottest rows of any shard (a hit saves "
                        "the network: best when it is slower than PCIe), or of the rank's own shard (the other "
                        "ranks' requests for them are served from its GPU: best on NVLink-linked GPUs) [any]")
    p.add_argument("--dist-timeout", type=_positive(float, 1e-3), default=600.0, metavar="SECONDS",
                   help="how long a rank waits for the others in a collective (the features' exchange, DDP) before "
                        "it fails [600]")
    p.add_argument("--max-batches", type=_positive(int), default=None, help="stop each epoch after this many batches")
    p.add_argument("--eval-nodes", type=_positive(int, 0), default=10_000,
                   help="validation/test nodes evaluated (0: no evaluation) [10000]")
    p.add_argument("--memory-gb", type=_positive(float, 1e-9), default=None,
                   help="host-memory budget of the papers preset")
    p.add_argument("--seed", type=int, default=0, help="seed of data, sampling and model [0]")
    p.add_argument("--prefetch", type=_positive(int, 0), default=1, help="batches prepared ahead by a background "
                                                                         "thread [1]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--gpus", type=_positive(int), default=None,
                   help="data parallel: spawn N processes, one per GPU (N CPU processes with gloo on a machine "
                        "without CUDA), DDP over one shared host copy of graph and features; --batch-size is "
                        "then per process (global batch = N x batch). Under torchrun the job's processes are used "
                        "(RANK/WORLD_SIZE/LOCAL_RANK); --gpus may be left out")
    p.add_argument("--json", type=Path, default=None, help="also write the per-epoch numbers to this JSON file")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="after each epoch write a checkpoint to DIR/checkpoint.pt (model, optimizer, epoch, random "
                        "states, settings)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR at its next epoch, up to --epochs in all (the settings that "
                        "shape the model and data must match); keeps saving to DIR unless --save names another")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="train on when a batch's loss is NaN or infinite (by default training stops, naming the epoch "
                        "and batch)")
    p.set_defaults(func=train_gnn)

    q = sub.add_parser("prepare-dataset", help="generate a synthetic preset, or import your graph (--from), into a "
                                               "dataset directory of .npy files",
                       description="Write preset NAME (tiny, reddit, products, papers) to DIR; "
                                   "`datapath train-gnn --dataset DIR` then loads it memory-mapped. The dataset is "
                                   "written into a temporary sibling directory and renamed into place when complete.")
    q.add_argument("name", metavar="NAME|SRC", help="tiny, reddit, products or papers; with --from: the source")
    q.add_argument("directory", type=Path)
    q.add_argument("--memory-gb", type=_positive(float, 1e-9), default=None,
                   help="papers only: host memory for features + graph [a quarter of RAM]")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--device", choices=("cuda", "cpu"), default=None, help="where to generate [cuda if available]")
    q.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIRECTORY")
    q.add_argument("--shards", type=_positive(int), default=None, metavar="N",
                   help="write the features as N shard files (features.shard-R-of-N.npy), one per rank of a "
                        "train-gnn --shard-features job of N ranks; a machine then needs only its ranks' shard "
                        "files beside the other files [one features.npy]")
    from datapath.apps.prepare import add_import_arguments  # noqa: PLC0415

    add_import_arguments(q)
    q.set_defaults(func=prepare)


def prepare(args: argparse.Namespace) -> int:
    from datapath._runtime.interrupts import terminate_raises  # noqa: PLC0415

    with terminate_raises():  # SIGTERM: the temporary directory goes, as with Ctrl-C
        return _prepare(args)


def _prepare(args: argparse.Namespace) -> int:
    from datapath.apps.prepare import check_import_arguments, run_import  # noqa: PLC0415
    from datapath.graph import prepare_dataset  # noqa: PLC0415

    if args.source_kind is not None:
        args.name_or_source = args.name
        return run_import(args)
    check_import_arguments(args)
    t0 = time.perf_counter()
    from datapath.graph.hetero_synthetic import HETERO_PRESETS, generate_hetero  # noqa: PLC0415

    if args.name in HETERO_PRESETS:  # a heterogeneous preset (IGBH- or MAG-shaped)
        if args.directory.exists() and any(args.directory.iterdir()) and not args.overwrite:
            raise ValueError(f"{args.directory} is not empty; pass --overwrite to replace it")
        from datapath.apps.prepare import hetero_bytes_needed  # noqa: PLC0415
        from datapath.graph._files import check_free_space  # noqa: PLC0415

        where = next(p for p in (args.directory.absolute(), *args.directory.absolute().parents) if p.exists())
        check_free_space(where, hetero_bytes_needed(HETERO_PRESETS[args.name]))  # before generating
        data = generate_hetero(args.name, seed=args.seed, device=args.device or ("cuda" if _cuda() else "cpu"))
        data.save(args.directory, overwrite=args.overwrite)
        print(f"wrote {args.name} to {args.directory}: {data.graph} ({time.perf_counter() - t0:.1f} s)")
        return 0
    d = prepare_dataset(args.name, args.directory, memory_gb=args.memory_gb, seed=args.seed, device=args.device,
                        overwrite=args.overwrite, shards=args.shards, progress=not args.no_progress)
    meta = json.loads((d / "meta.json").read_text())
    shards = f" in {args.shards} shards" if args.shards else ""
    print(f"wrote {meta['name']} to {d}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, "
          f"{meta['num_features']} features{shards}, {meta['num_classes']} classes ({time.perf_counter() - t0:.1f} s)")
    return 0


def train_gnn(args: argparse.Namespace) -> int:
    from datapath.apps.train_gnn import TrainConfig, run_training  # noqa: PLC0415

    cfg = TrainConfig(dataset=args.dataset, model=args.model, epochs=args.epochs, batch_size=args.batch_size,
                      fanouts=tuple(args.fanouts), hidden=args.hidden, heads=args.heads, dropout=args.dropout,
                      lr=args.lr, optimizer=args.optimizer, device=args.device, features_on=args.features_on,
                      graph_on=args.graph_on, max_batches=args.max_batches, eval_nodes=args.eval_nodes,
                      gpu_cache=args.gpu_cache, host_memory=args.host_memory, cache_policy=args.cache_policy,
                      disk_superbatch=args.disk_superbatch,
                      shard_features=args.shard_features, cache_scope=args.cache_scope,
                      dist_timeout_s=args.dist_timeout,
                      memory_gb=args.memory_gb, seed=args.seed, prefetch=args.prefetch,
                      progress=not args.no_progress, json=str(args.json) if args.json is not None else None,
                      save=args.save, resume=args.resume, allow_nonfinite=args.allow_nonfinite)
    cfg.validate()
    if args.device == "cuda":
        from datapath._runtime.device import require_cuda  # noqa: PLC0415

        require_cuda("train-gnn --device cuda")
    if not Path(args.dataset).is_dir():
        from datapath.graph import PRESETS  # noqa: PLC0415

        from datapath.graph.hetero_synthetic import HETERO_PRESETS  # noqa: PLC0415

        if args.dataset not in PRESETS and args.dataset != "papers" and args.dataset not in HETERO_PRESETS:
            raise ValueError(f"--dataset {args.dataset!r} is neither a dataset directory nor a preset "
                             f"({', '.join(sorted([*PRESETS, 'papers']))})")
    try:
        run_training(cfg, args.gpus)
    except Exception as exc:
        _tell_torchrun(exc)
        raise
    return 0


def _cuda() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _tell_torchrun(exc: BaseException) -> None:
    """Under torchrun, write ``exc`` to the worker's error file: torchrun's failure report then shows it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler  # noqa: PLC0415

        try:
            raise exc
        except BaseException as e:  # noqa: BLE001 - record_exception reads the exception being handled
            ErrorHandler().record_exception(e)
