"""``datapath train-gnn`` (the main job) and ``datapath prepare-dataset``."""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("datapath.loaders.cli")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "train-gnn",
        help="train GraphSAGE or GAT with GPU neighbor sampling and zero-copy feature loading",
        description="Mini-batch GNN node classification. With no arguments: GraphSAGE on the built-in "
                    "'tiny' dataset (generated in a second), on the GPU when there is one, else the CPU.",
    )
    p.add_argument("--dataset", default="tiny",
                   help="preset (tiny, reddit, products, papers) or a directory from prepare-dataset [tiny]")
    p.add_argument("--model", choices=("sage", "gat"), default="sage", help="GNN [sage]")
    p.add_argument("--epochs", type=int, default=4, help="epochs [4]")
    p.add_argument("--batch-size", type=int, default=512, help="seed nodes per batch [512]")
    p.add_argument("--fanouts", default="10,5", help="neighbours per hop, seeds first; one layer per hop [10,5]")
    p.add_argument("--hidden", type=int, default=128, help="hidden width [128]")
    p.add_argument("--heads", type=int, default=4, help="GAT attention heads [4]")
    p.add_argument("--dropout", type=float, default=0.3, help="dropout [0.3]")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate [3e-3]")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="where to train [cuda if available]")
    p.add_argument("--features-on", choices=("unified", "cuda", "cpu"), default=None,
                   help="where node features and labels live: unified (pinned host memory read by the GPU, "
                        "zero copy), cuda (GPU memory), cpu (pageable; CPU gather + copy) [unified]")
    p.add_argument("--graph-on", choices=("unified", "cuda", "cpu"), default=None,
                   help="where the graph lives; unified/cuda sample on the GPU, cpu on the CPU [as --features-on]")
    p.add_argument("--max-batches", type=int, default=None, help="stop each epoch after this many batches")
    p.add_argument("--eval-nodes", type=int, default=10_000, help="validation/test nodes evaluated [10000]")
    p.add_argument("--memory-gb", type=float, default=None, help="host-memory budget of the papers preset")
    p.add_argument("--seed", type=int, default=0, help="seed of data, sampling and model [0]")
    p.add_argument("--prefetch", type=int, default=1, help="batches prepared ahead by a background thread [1]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--gpus", type=int, default=None,
                   help="data parallel: spawn N processes, one per GPU (N CPU processes with gloo on a machine "
                        "without CUDA), DDP over one shared host copy of graph and features; --batch-size is "
                        "then per process (global batch = N x batch). Under torchrun the job's processes are used "
                        "(RANK/WORLD_SIZE/LOCAL_RANK); --gpus may be left out")
    p.add_argument("--json", type=Path, default=None, help="also write the per-epoch numbers to this JSON file")
    p.set_defaults(func=train_gnn)

    q = sub.add_parser("prepare-dataset", help="generate a synthetic dataset preset into a directory of .npy files",
                       description="Write preset NAME (tiny, reddit, products, papers) to DIR; "
                                   "`datapath train-gnn --dataset DIR` then loads it memory-mapped.")
    q.add_argument("name", help="tiny, reddit, products or papers")
    q.add_argument("directory", type=Path)
    q.add_argument("--memory-gb", type=float, default=None,
                   help="papers only: host memory for features + graph [a quarter of RAM]")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--device", choices=("cuda", "cpu"), default=None, help="where to generate [cuda if available]")
    q.set_defaults(func=prepare)


def prepare(args: argparse.Namespace) -> int:
    from datapath.loaders.datasets import prepare_dataset  # noqa: PLC0415

    t0 = time.perf_counter()
    d = prepare_dataset(args.name, args.directory, memory_gb=args.memory_gb, seed=args.seed, device=args.device)
    meta = json.loads((d / "meta.json").read_text())
    print(f"wrote {meta['name']} to {d}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, "
          f"{meta['num_features']} features, {meta['num_classes']} classes ({time.perf_counter() - t0:.1f} s)")
    return 0


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def train_gnn(args: argparse.Namespace) -> int:
    from datapath.loaders.errors import CudaAutogradUnavailableError  # noqa: PLC0415

    try:
        if args.gpus is not None or _under_torchrun():
            return _train_gnn_distributed(args)
        return _train_gnn(args)
    except CudaAutogradUnavailableError as exc:
        print(f"error: {exc}")
        return 1


def _under_torchrun() -> bool:
    import os  # noqa: PLC0415

    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _train_gnn_distributed(args: argparse.Namespace) -> int:
    """``train-gnn --gpus N`` / under torchrun: `datapath.loaders.distributed.run_training`."""
    import torch  # noqa: PLC0415

    from datapath.loaders.distributed import DistributedError, TrainConfig, run_training  # noqa: PLC0415

    if args.gpus is not None and args.gpus < 1:
        print(f"error: --gpus must be >= 1, got {args.gpus}")
        return 2
    if "cuda" in (args.features_on, args.graph_on) or "cpu" in (args.features_on, args.graph_on):
        print("error: with --gpus (or torchrun) the graph and features stay in one shared host copy read "
              "zero-copy by every GPU; leave --features-on/--graph-on out (or set them to unified)")
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and args.gpus is not None and args.gpus > torch.cuda.device_count():
        print(f"error: --gpus {args.gpus} but this machine has {torch.cuda.device_count()} GPUs")
        return 2
    cfg = TrainConfig(dataset=args.dataset, model=args.model, epochs=args.epochs, batch_size=args.batch_size,
                      fanouts=tuple(int(f) for f in args.fanouts.split(",")), hidden=args.hidden,
                      heads=args.heads, dropout=args.dropout, lr=args.lr, device=device,
                      max_batches=args.max_batches, eval_nodes=args.eval_nodes, memory_gb=args.memory_gb,
                      seed=args.seed, prefetch=args.prefetch, progress=not args.no_progress,
                      json=str(args.json) if args.json is not None else None)
    try:
        run_training(cfg, args.gpus)
    except DistributedError as exc:
        print(f"error: {exc}")
        return 1
    return 0


def _train_gnn(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    from tqdm.auto import tqdm  # noqa: PLC0415

    from datapath.loaders._cuda_sched import use_blocking_sync  # noqa: PLC0415

    has_cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if has_cuda else "cpu")
    if device == "cuda":
        if not has_cuda:
            from datapath._runtime import require_cuda  # noqa: PLC0415

            require_cuda("train-gnn --device cuda")
        use_blocking_sync()

    from datapath.loaders.datasets import get_dataset  # noqa: PLC0415
    from datapath.loaders.loader import NeighborLoader  # noqa: PLC0415
    from datapath.loaders.sampler import NeighborSampler  # noqa: PLC0415
    from datapath.loaders.training import evaluate, train_epoch  # noqa: PLC0415
    from datapath.loaders._placement import to_placement  # noqa: PLC0415
    from datapath.nn.models import build_model  # noqa: PLC0415

    features_on = args.features_on or ("unified" if device == "cuda" else "cpu")
    graph_on = args.graph_on or features_on
    if device == "cpu" and "cuda" in (features_on, graph_on):
        print("error: --features-on/--graph-on cuda need --device cuda")
        return 2
    fanouts = [int(f) for f in args.fanouts.split(",")]
    progress = not args.no_progress
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    ds = get_dataset(args.dataset, progress=progress, memory_gb=args.memory_gb, seed=args.seed,
                     device="cpu" if args.dataset == "tiny" else None)
    print(f"dataset {ds.name}: {ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges, "
          f"{ds.num_features} features, {ds.num_classes} classes, {ds.train_idx.numel():,} training nodes "
          f"({time.perf_counter() - t0:.1f} s)")
    graph = ds.graph.to(graph_on)
    feats = to_placement(ds.features, features_on)
    labels = to_placement(ds.labels, features_on)
    model = build_model(args.model, ds.num_features, args.hidden, ds.num_classes, len(fanouts),
                        dropout=args.dropout, heads=args.heads).to(device)
    sampler = NeighborSampler(fanouts, seed=args.seed)
    # the model's aggregation schedules are built in the loader's thread: no host sync in the step
    loader = NeighborLoader(graph, ds.train_idx, sampler, args.batch_size, shuffle=True, features=feats,
                            labels=labels, device=device, seed=args.seed, prefetch=args.prefetch,
                            prepare=model.prepare_batch)
    gen = torch.Generator().manual_seed(args.seed)

    def eval_loader(idx: torch.Tensor) -> NeighborLoader:
        idx = idx[torch.randperm(idx.numel(), generator=gen)[: args.eval_nodes]]
        return NeighborLoader(graph, idx, NeighborSampler(fanouts, seed=args.seed + 1), 4 * args.batch_size,
                              features=feats, labels=labels, device=device, prefetch=args.prefetch)

    val_loader, test_loader = eval_loader(ds.val_idx), eval_loader(ds.test_idx)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=torch.device(device).type == "cuda")
    print(f"training {args.model} ({len(fanouts)} layers, fanouts {fanouts}, hidden {args.hidden}) on {device}: "
          f"graph in {graph_on} memory, features in {features_on} memory, sampling on {loader.sample_device.type}; "
          f"chance accuracy {1 / ds.num_classes:.3f}")
    n_batches = len(loader) if args.max_batches is None else min(len(loader), args.max_batches)
    history = []
    for epoch in range(args.epochs):
        with tqdm(total=n_batches, desc=f"epoch {epoch}", unit="batch", disable=not progress, leave=False) as bar:
            st = train_epoch(model, loader, opt, max_batches=args.max_batches, progress=bar)
        val_acc = evaluate(model, val_loader)
        row = {"epoch": epoch, **st.as_dict(), "val_acc": val_acc}
        row.pop("losses")
        history.append(row)
        print(f"epoch {epoch}: loss {st.loss:.4f}  train acc {st.train_acc:.3f}  val acc {val_acc:.3f}  "
              f"time {st.epoch_s:.2f} s (sample {st.sample_s:.2f}, gather {st.gather_s:.2f}, "
              f"train {st.train_s:.2f}, waiting for data {st.wait_s:.2f})  CPU {st.cpu_s:.2f} s  "
              f"peak GPU memory {_fmt_bytes(st.peak_gpu_bytes)}")
    test_acc = evaluate(model, test_loader)
    print(f"test accuracy {test_acc:.3f} (chance {1 / ds.num_classes:.3f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"dataset": ds.name, "model": args.model, "device": device,
                                         "features_on": features_on, "graph_on": graph_on, "fanouts": fanouts,
                                         "epochs": history, "test_acc": test_acc}, indent=1))
    return 0
