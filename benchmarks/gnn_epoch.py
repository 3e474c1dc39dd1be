"""B2: GNN training epoch with the graph and features in host memory (PyTorch-Direct Fig. 4.8).

Ways (same model, same seed, same batches: the CPU and GPU samplers draw identical samples):

- ``py``           graph and features in pageable host memory; CPU sampling, CPU gather, copy to the
                   GPU (the DGL/PyG default pipeline; our vectorized CPU sampler);
- ``datapath``     graph and features in unified memory (pinned in place); GPU sampling over PCIe,
                   zero-copy GPU gather, next batch prepared on a side stream;
- ``gpu_resident`` graph and features copied to GPU memory (the lower bound when they fit);
- ``datapath_cache`` a `datapath.features.FeatureStore` over the pinned table with a GPU cache of
                   the hottest rows (``--gpu-cache-frac`` of the feature bytes, presampled), graph on
                   the GPU when it fits (the same graph object as ``gpu_resident``);
- ``datapath_disk`` the table in a ``.npy`` file, the same GPU cache, ``--host-memory-frac`` of the
                   feature bytes in pinned host memory and the rest read from the file (O_DIRECT);
                   the disk's random-read bandwidth probed and the rows checked in the same run
                   (`benchmarks/_gnn_tiers.py`).

Per way: time of a fixed number of batches (after ``--warmup`` batches, ``--rounds`` rounds of
``--batches`` batches, each from the start of a new epoch; datapath and gpu_resident alternate
rounds and report their median round; the per-batch time times the full epoch's batch count gives
the extrapolated epoch time), process CPU time (psutil), peak GPU memory, the per-batch losses and
the validation accuracy, plus a synchronized per-stage breakdown (sample / gather+copy / train)
measured on ``--profile-batches`` further batches.

    PYTHONPATH=src:. python benchmarks/gnn_epoch.py            # products + reddit, GraphSAGE + GAT
    PYTHONPATH=src:. python benchmarks/gnn_epoch.py --quick    # small graphs, < 1 minute
    PYTHONPATH=src:. python benchmarks/gnn_epoch.py --full     # adds the papers shape (~40 GB features)
    PYTHONPATH=src:. python benchmarks/gnn_epoch.py --datasets papers --models sage --name gnn_epoch_papers \
        --ways datapath,datapath_cache,gpu_resident,datapath_disk   # the papers tiers (issue 16)

Besides the per-way rows, the JSON holds ``records``: one per feature placement with the issue's
fields ``{dataset, model, features_on, gpu_cache_frac, host_memory_gb, epoch_s, resident_epoch_s,
hit_rate, device}`` (+ ``rows_match, disk_read_GBps, disk_probe_GBps`` for the disk tier).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import logging
import time
from typing import Any

import torch

from datapath.apps.machine import use_blocking_sync  # noqa: E402

BLOCKING_SYNC = use_blocking_sync() if torch.cuda.is_available() else False  # before CUDA starts

from benchmarks import _gnn_tiers as tiers  # noqa: E402
from benchmarks._common import RESULTS_DIR, print_table, write_result  # noqa: E402
from datapath.apps import evaluate, train_epoch  # noqa: E402
from datapath.apps.machine import device_label  # noqa: E402
from datapath.apps.training import check_cuda_autograd, profile_batches  # noqa: E402
from datapath.features import FeatureStore, place_graph  # noqa: E402
from datapath.graph import Graph, SyntheticSpec, generate, papers_spec, preset_spec  # noqa: E402
from datapath.loaders import NeighborLoader  # noqa: E402
from datapath.memory import to_placement  # noqa: E402
from datapath.sampling import NeighborSampler  # noqa: E402
from datapath.unified_tensor import as_unified  # noqa: E402
from datapath.nn.models import build_model  # noqa: E402

log = logging.getLogger("datapath.bench.gnn_epoch")

WAYS = ("py", "datapath", "datapath_cache", "gpu_resident", "datapath_disk")
PLACEMENT = {"py": "cpu", "datapath": "unified", "gpu_resident": "cuda", "datapath_cache": "gpu_cache+unified",
             "datapath_disk": "gpu_cache+host+disk"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small graphs and few batches (< 1 minute)")
    p.add_argument("--full", action="store_true", help="also the papers shape with --papers-feature-gb of features")
    p.add_argument("--datasets", default=None, help="comma list of products, reddit, papers")
    p.add_argument("--models", default="sage,gat")
    p.add_argument("--ways", default="py,datapath,datapath_cache,gpu_resident",
                   help=f"comma list of {', '.join(WAYS)} [py,datapath,datapath_cache,gpu_resident]")
    p.add_argument("--gpu-cache-frac", type=float, default=0.25, help="GPU cache of the store ways [0.25]")
    p.add_argument("--host-memory-frac", type=float, default=0.25, help="host memory of datapath_disk [0.25]")
    p.add_argument("--presample-batches", type=int, default=64, help="batches presampled to rank rows [64]")
    p.add_argument("--disk-dir", default="bench-disk", help="where datapath_disk writes its table [bench-disk]")
    p.add_argument("--disk-batches", type=int, default=None, help="timed batches per round of datapath_disk")
    p.add_argument("--disk-rounds", type=int, default=1, help="timed rounds of datapath_disk [1]")
    p.add_argument("--verify-batches", type=int, default=8, help="batches whose rows datapath_disk checks [8]")
    p.add_argument("--disk-superbatch-frac", type=float, default=1.0,
                   help="share of datapath_disk's host memory used as superbatch staging (the host tier gets the "
                        "rest; 0: no superbatches, batches read row by row) [1.0]")
    p.add_argument("--disk-buffers", type=int, default=1, help="staging buffers of datapath_disk (1 or 2) [1]")
    p.add_argument("--disk-full-epoch", action="store_true",
                   help="datapath_disk's timed round is one whole epoch (every batch's rows checked against the "
                        "table), and gpu_resident also trains one whole timed epoch (resident_epoch_s)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per way and round [30; quick 10]")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per way, datapath and gpu_resident alternating; the median is reported "
                        "(py, 10x slower, runs one) [5; quick 1]")
    p.add_argument("--warmup", type=int, default=None, help="untimed batches first [5; quick 3]")
    p.add_argument("--profile-batches", type=int, default=None, help="batches of the stage breakdown [6]")
    p.add_argument("--eval-nodes", type=int, default=4096)
    p.add_argument("--papers-feature-gb", type=float, default=40.0)
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="gnn_epoch", help="result file name (results/NAME.json, NAME.png)")
    p.add_argument("--prefetch", type=int, default=1, help="batches each loader thread prepares ahead [1]")
    p.add_argument("--loader-workers", type=int, default=1, help="loader threads [1]")
    p.add_argument("--sample-blocks-per-sm", type=int, default=32, help="grid of the sampling kernel [32]")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="the GPU sampler launches its kernels one by one instead of replaying a captured CUDA graph")
    p.add_argument("--loader-priority", type=int, default=0, help="CUDA priority of the loader's stream [0]")
    p.add_argument("--no-prepare", action="store_true",
                   help="build the aggregation schedules in the training step (host syncs there) instead of "
                        "in the loader's thread (NeighborLoader(prepare=model.prepare_batch))")
    p.add_argument("--gather-blocks-per-sm", type=int, default=None,
                   help="grid of the zero-copy gather (datapath.unified_tensor.config.blocks_per_sm)")
    p.add_argument("--serial-gather", action="store_true",
                   help="gather the features on the loader's sampling stream and wait for them (the loader "
                        "before it gathered on a stream of its own): for comparison")
    p.add_argument("--gather-stream", default="sample", choices=["sample", "own"],
                   help="queue the feature gather on the loader's sampling stream (PCIe used by one at a "
                        "time) or on a stream of its own (concurrent with the next batches' sampling) [sample]")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval (seconds) for this process: how long a Python thread may hold "
                        "the GIL while another waits (Python's default 0.005)")
    args = p.parse_args()
    args.batches = args.batches or (10 if args.quick else 30)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    args.profile_batches = args.profile_batches or (3 if args.quick else 6)
    if args.datasets is None:
        args.datasets = "products,reddit" + (",papers" if args.full else "")
    if args.switch_interval is not None:
        import sys

        sys.setswitchinterval(args.switch_interval)
    if args.gather_blocks_per_sm is not None:
        from datapath.unified_tensor import config

        config.blocks_per_sm = args.gather_blocks_per_sm
    return args


def dataset_spec(name: str, args: argparse.Namespace) -> SyntheticSpec:
    if name == "papers":
        per_node = 128 * 4 + 2 * 14.5 * 4 + 16
        spec = papers_spec(args.papers_feature_gb * per_node / 512, seed=args.seed)
    else:
        spec = preset_spec(name, seed=args.seed)
    if args.quick:  # same shape statistics, 1/20 of the nodes and edges
        spec = dataclasses.replace(spec, name=f"{spec.name}-quick", num_nodes=max(spec.num_nodes // 20, 10_000),
                                   num_edges=max(spec.num_edges // 20, 100_000))
    return spec


@dataclasses.dataclass
class _Way:
    """One way's model, optimizer and loaders, and the stats of its timed rounds."""

    way: str
    model_name: str
    model: Any
    opt: Any
    loader: Any
    val_loader: Any
    placed: dict[str, Any]
    warm: Any = None
    rounds: list[Any] = dataclasses.field(default_factory=list)
    store_stats: list[Any] = dataclasses.field(default_factory=list)  # the store's tiers in each timed round
    val_acc_first: float | None = None  # after the warm-up and the first round: the same batches for every way
    reference: Any = None  # datapath_disk with --disk-full-epoch: the table the batches are checked against
    epoch_check: Any = None
    full_epoch: Any = None  # gpu_resident with --disk-full-epoch: one whole timed epoch


def setup_way(way: str, model_name: str, ds: Any, placed: dict[str, Any], args: argparse.Namespace,
              device: torch.device) -> _Way:
    fanouts = [int(f) for f in args.fanouts.split(",")]
    graph, feats, labels = placed["graph"], placed["features"], placed["labels"]
    torch.manual_seed(args.seed)
    model = build_model(model_name, ds.num_features, args.hidden, ds.num_classes, len(fanouts),
                        dropout=0.5, heads=args.heads).to(device)
    fused = device.type == "cuda"  # one kernel per step instead of several per parameter, for every way
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=fused)
    sampler = NeighborSampler(fanouts, seed=args.seed, blocks_per_sm=args.sample_blocks_per_sm,
                              cuda_graphs=not args.no_cuda_graphs)
    loader = NeighborLoader(graph, ds.train_idx, sampler, args.batch_size,
                            shuffle=True, features=feats, labels=labels, device=device, seed=args.seed,
                            prefetch=args.prefetch, num_workers=args.loader_workers,
                            stream_priority=args.loader_priority,
                            prepare=None if args.no_prepare else model.prepare_batch)
    loader.gather_stream = "serial" if args.serial_gather else args.gather_stream
    gen = torch.Generator().manual_seed(args.seed)
    val = ds.val_idx[torch.randperm(ds.val_idx.numel(), generator=gen)[: args.eval_nodes]]
    val_loader = NeighborLoader(graph, val, NeighborSampler(fanouts, seed=args.seed + 1), args.batch_size,
                                features=feats, labels=labels, device=device)
    w = _Way(way, model_name, model, opt, loader, val_loader, placed)
    w.warm = tiers.warm_up(way, loader, model, opt, args)
    return w


def time_round(w: _Way, args: argparse.Namespace) -> None:
    """One timed round: ``args.batches`` batches from the start of a new epoch (then, after the first,
    the validation accuracy: py runs one round, so the ways are compared there)."""
    torch.manual_seed(args.seed * 1000 + len(w.rounds))  # the same dropout masks for every way in a round
    store = w.loader.features if isinstance(w.loader.features, FeatureStore) else None
    if store is not None:
        store.reset_stats()
    batches = args.disk_batches if w.way == "datapath_disk" and args.disk_batches else args.batches
    loader: Any = w.loader
    if w.way == "datapath_disk" and args.disk_full_epoch:
        batches, loader = None, tiers.CheckedLoader(w.loader, w.reference)
        print(f"  {w.way}: timing one whole epoch ({len(w.loader)} batches)", flush=True)
    w.rounds.append(train_epoch(w.model, loader, w.opt, max_batches=batches))
    if isinstance(loader, tiers.CheckedLoader):
        w.epoch_check = loader.result()
    if store is not None:
        w.store_stats.append(store.stats())
    if w.val_acc_first is None:
        w.val_acc_first = evaluate(w.model, w.val_loader)


def finish_way(w: _Way, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Validation accuracy, the serial stage breakdown, and the result row (median round)."""
    fused = device.type == "cuda"
    if w.way == "gpu_resident" and args.disk_full_epoch:
        torch.manual_seed(args.seed * 1000 + 999)
        w.full_epoch = train_epoch(w.model, w.loader, w.opt)
    acc_final = evaluate(w.model, w.val_loader)
    twin = copy.deepcopy(w.model)  # profiled on a copy so that the stage breakdown leaves the model alone
    prof = profile_batches(twin, w.loader, torch.optim.Adam(twin.parameters(), lr=args.lr, fused=fused),
                           args.profile_batches)
    per_round = [r.epoch_s / max(r.batches, 1) for r in w.rounds]
    st = sorted(w.rounds, key=lambda r: r.epoch_s / max(r.batches, 1))[len(w.rounds) // 2]  # the median round
    per_batch = st.epoch_s / max(st.batches, 1)
    nb = max(st.batches, 1)
    extra: dict[str, Any] = {}
    if w.store_stats:
        rows = {k: sum(s[k]["rows"] for s in w.store_stats) for k in w.store_stats[0]}
        total = sum(rows.values())
        extra = {"hit_rate": {k: v / total for k, v in rows.items()}, "store_stats_rounds": w.store_stats,
                 "gpu_cache_frac": args.gpu_cache_frac, "store_tiers": w.loader.features.tiers()}
    if w.full_epoch is not None:
        extra["full_epoch_s"] = w.full_epoch.epoch_s
        extra["full_epoch_batches"] = w.full_epoch.batches
    return {
        **extra,
        "epoch_measured": st.batches == len(w.loader),
        "way": w.way, "model": w.model_name, "sample_on": w.loader.sample_device.type,
        "graph_in": w.loader.graph.placement, "features_in": PLACEMENT[w.way],
        "batches_timed": st.batches, "rounds": len(w.rounds), "per_batch_s_rounds": per_round,
        "batches_per_epoch": len(w.loader), "warmup_batches": w.warm.batches,
        "time_s": st.epoch_s, "per_batch_s": per_batch, "epoch_s_extrapolated": per_batch * len(w.loader),
        "cpu_s": st.cpu_s, "cpu_s_per_batch": st.cpu_s / max(st.batches, 1),
        "overlapped_stage_s": {"sample": st.sample_s, "gather": st.gather_s, "train": st.train_s,
                               "wait_for_data": st.wait_s},
        "serial_breakdown_per_batch_s": prof,
        "pipeline_ms_per_batch": {  # where the median round's time went, per batch
            "consumer_cpu": st.consumer_cpu_s / nb * 1e3, "consumer_wait_for_data": st.wait_s / nb * 1e3,
            "producer_wall": (st.sample_s + st.gather_s) / nb * 1e3, "producer_cpu": st.producer_cpu_s / nb * 1e3,
            "producer_gpu_wait": st.producer_gpu_wait_s / nb * 1e3,
            "producer_queue_wait": st.producer_queue_wait_s / nb * 1e3},
        "peak_gpu_bytes": max(r.peak_gpu_bytes or 0 for r in w.rounds) or None,
        "loss": st.loss, "losses": w.rounds[0].losses if w.rounds else [],
        "losses_later_rounds": [x for r in w.rounds[1:] for x in r.losses],
        "train_acc": st.train_acc, "val_acc": w.val_acc_first, "val_acc_after_all_rounds": acc_final,
    }


def place(ds: Any, way: str, shared: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Graph, features and labels where ``way`` keeps them (``shared``: the GPU graph and hotness, made once)."""
    where = PLACEMENT[way]
    t0 = time.perf_counter()
    if way in ("gpu_resident", "datapath_cache", "datapath_disk"):
        if "cuda_graph" not in shared:
            shared["cuda_graph"] = ds.graph.to("cuda") if way == "gpu_resident" else place_graph(ds.graph)
        graph = shared["cuda_graph"]
    if way in ("datapath_cache", "datapath_disk") and "hotness" not in shared:
        t1 = time.perf_counter()
        shared["hotness"] = tiers.hotness(graph, ds, args)
        shared["presample_s"] = time.perf_counter() - t1
    if way == "datapath_cache":
        out = {"graph": graph, "features": tiers.cache_store(as_unified(ds.features), shared["hotness"],
                                                             args.gpu_cache_frac),
               "labels": ds.labels.to("cuda")}
    elif way == "datapath_disk":
        store, build_s = tiers.disk_store(shared["disk_file"], shared["hotness"], args, shared["disk_costs"])
        shared["store_build_s"] = build_s
        out = {"graph": graph, "features": store, "labels": ds.labels.to("cuda")}
    elif way == "gpu_resident":
        out = {"graph": graph, "features": ds.features.to("cuda"), "labels": ds.labels.to("cuda")}
    elif where == "unified" and torch.cuda.is_available():
        # pinned in place (cudaHostRegister), as a user with a table of tens of GB would: no second copy
        g = ds.graph
        out = {"graph": Graph(as_unified(g.indptr), as_unified(g.indices), validate=False),
               "features": as_unified(ds.features), "labels": as_unified(ds.labels)}
    else:
        out = {"graph": ds.graph.to(where), "features": to_placement(ds.features, where),
               "labels": to_placement(ds.labels, where)}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out["seconds"] = time.perf_counter() - t0
    return out


def plot(results: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dataset"], r["model"]) for r in results}, key=lambda g: (g[0], g[1] != "sage"))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 4.2), squeeze=False)
    colors = {"sample": "#8c8c8c", "gather": "#d62728", "train": "#1f77b4"}
    for ax, (dsn, model) in zip(axes[0], groups):
        rows = [r for r in results if r["dataset"] == dsn and r["model"] == model]
        rows.sort(key=lambda r: WAYS.index(r["way"]))
        for i, r in enumerate(rows):
            prof = r["serial_breakdown_per_batch_s"]
            n = r["batches_per_epoch"]
            bottom = 0.0
            for part, key in (("sample", "sample_s"), ("gather", "gather_s"), ("train", "train_s")):
                h = prof[key] * n
                ax.bar(i, h, bottom=bottom, color=colors[part], width=0.6,
                       label=f"{part} (serial)" if i == 0 else None)
                bottom += h
            ax.plot([i - 0.35, i + 0.35], [r["epoch_s_extrapolated"]] * 2, color="k", lw=2,
                    label="epoch (overlapped)" if i == 0 else None)
            base = next((x for x in rows if x["way"] == "py"), None)
            if base is not None and r["way"] != "py":
                ax.text(i, r["epoch_s_extrapolated"], f"{base['epoch_s_extrapolated'] / r['epoch_s_extrapolated']:.2f}x",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [r["way"].replace("_", "\n") for r in rows], fontsize=8)
        ax.set_title(f"{dsn} {model}", fontsize=9)
        ax.set_ylabel("epoch time (s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("B2 GNN epoch (extrapolated from the timed batches): stage breakdown measured serially, "
                 "black line = measured overlapped epoch; label = speedup over py", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _release_memory(cuda: bool) -> None:
    """Give cached GPU memory and cached pinned host memory back between datasets and ways."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse()
    cuda = torch.cuda.is_available()
    if cuda:
        check_cuda_autograd()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ways = [w for w in args.ways.split(",") if cuda or w == "py"]
    if not cuda:
        log.warning("no CUDA: running only the 'py' way on the CPU (a smoke test, not B2)")
    results: list[dict[str, Any]] = []
    datasets: dict[str, Any] = {}
    t_start = time.perf_counter()
    for name in args.datasets.split(","):
        spec = dataset_spec(name, args)
        t0 = time.perf_counter()
        try:
            ds = generate(spec, progress=False)
        except (RuntimeError, MemoryError) as exc:  # papers may not fit
            log.error("generating %s failed: %s", spec.name, exc)
            datasets[spec.name] = {"error": str(exc)}
            continue
        gen_s = time.perf_counter() - t0
        _release_memory(cuda)
        datasets[spec.name] = {"spec": dataclasses.asdict(spec), "generate_s": gen_s,
                               "num_nodes": ds.graph.num_nodes, "num_edges": ds.graph.num_edges,
                               "feature_bytes": ds.features.numel() * 4, "place_s": {}}
        print(f"{spec.name}: {ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges, "
              f"{ds.features.numel() * 4 / 2**30:.1f} GiB features, generated in {gen_s:.1f} s", flush=True)
        # py first, alone: pinning the table in place for datapath would make it "unified" for py too.
        # The in-memory ways then live side by side and their timed rounds alternate, so that drift
        # (clocks, allocator, the host) hits them alike; each reports its median round.  The disk way
        # comes last (it writes the table to a file first), compared with the resident rounds of this run.
        mem = [w for w in ways if w not in ("py", "datapath_disk")]
        groups = [[w] for w in ways if w == "py"] + [mem] + [[w] for w in ways if w == "datapath_disk"]
        shared: dict[str, Any] = {}
        for group in [g for g in groups if g]:
            if group == ["datapath_disk"] and not tiers.prepare_disk(ds, spec.name, shared, datasets, args):
                continue
            placed_by: dict[str, Any] = {}
            for way in group:
                try:
                    placed_by[way] = place(ds, way, shared, args)
                except (RuntimeError, MemoryError, OSError) as exc:
                    log.error("%s: placing for %s failed: %s", spec.name, way, exc)
                    datasets[spec.name]["place_s"][way] = f"failed: {exc}"
                    continue
                datasets[spec.name]["place_s"][way] = placed_by[way].pop("seconds")
            for key in ("presample_s", "store_build_s"):
                if key in shared:
                    datasets[spec.name][key] = shared[key]
            for model_name in args.models.split(","):
                t0 = time.perf_counter()
                ws = [setup_way(way, model_name, ds, placed_by[way], args, device) for way in placed_by]
                for w in ws:
                    if w.way == "datapath_disk":
                        w.reference = as_unified(ds.features)
                rounds = args.disk_rounds if group == ["datapath_disk"] else 1 if group == ["py"] else args.rounds
                for i in range(rounds):
                    for w in (ws if i % 2 == 0 else ws[::-1]):
                        time_round(w, args)
                for w in ws:
                    r = finish_way(w, args, device)
                    r["dataset"] = spec.name
                    if w.way == "datapath_disk":
                        r.update(tiers.disk_fields(w, ds, shared, args))
                    results.append(r)
                    write_result(args.name, {"partial": True, "datasets": datasets, "results": results})
                    rounds_txt = "/".join(f"{x * 1e3:.1f}" for x in r["per_batch_s_rounds"])
                    pipe = " ".join(f"{k} {v:.1f}" for k, v in r["pipeline_ms_per_batch"].items())
                    hits = " ".join(f"{k} {v:.2f}" for k, v in r.get("hit_rate", {}).items())
                    print(f"  {w.way:>14} {model_name}: {r['per_batch_s'] * 1e3:7.1f} ms/batch (rounds {rounds_txt}), "
                          f"cpu {r['cpu_s_per_batch'] * 1e3:7.1f} ms/batch, val acc {r['val_acc']:.3f} "
                          f"({time.perf_counter() - t0:.1f} s)\n      pipeline ms/batch: {pipe}"
                          + (f"\n      hit rate: {hits}" if hits else ""), flush=True)
                    if isinstance(w.loader.features, FeatureStore):
                        w.loader.features.close()
                del ws
                _release_memory(cuda)
            del placed_by
            _release_memory(cuda)
        if "disk_file" in shared:
            shared["disk_file"].unlink(missing_ok=True)
        del shared
        del ds
        _release_memory(cuda)
    summary = summarize(results)
    records = tiers.records(results, device_label())
    payload = {
        "records": records,
        "description": "B2 GNN training epoch (PyTorch-Direct Fig. 4.8): py vs datapath vs gpu_resident",
        "config": {k: v for k, v in vars(args).items()}, "cuda_blocking_sync": BLOCKING_SYNC,
        "loader_note": ("all ways use the same NeighborLoader, one batch prefetched by a background thread"
                        + ("" if args.no_prepare else
                           ", aggregation schedules built there (prepare=model.prepare_batch)")),
        "epoch_note": (f"each way trains {args.warmup} warm-up batches, then {args.rounds} rounds of {args.batches} "
                       f"timed batches (each from the start of a new shuffled epoch; datapath and gpu_resident "
                       f"alternate rounds); per_batch_s is the median round's; epoch_s_extrapolated = per-batch "
                       f"time x batches per epoch; val_acc after the warm-up and the first round (the same batches "
                       f"for every way; py runs one round), val_acc_after_all_rounds at the end"),
        "datasets": datasets, "results": results, "summary": summary,
        "total_s": time.perf_counter() - t_start,
    }
    path = write_result(args.name, payload)
    if results:
        plot(results, RESULTS_DIR / f"{args.name}.png")
    print(f"wrote {path}")
    rows = []
    for r in results:
        prof = r["serial_breakdown_per_batch_s"]
        rows.append({"dataset": r["dataset"], "model": r["model"], "way": r["way"],
                     "ms/batch": r["per_batch_s"] * 1e3, "epoch_s": r["epoch_s_extrapolated"],
                     "sample": prof["sample_s"] * 1e3, "gather": prof["gather_s"] * 1e3,
                     "train": prof["train_s"] * 1e3, "cpu_ms/b": r["cpu_s_per_batch"] * 1e3,
                     "gpu_GiB": (r["peak_gpu_bytes"] or 0) / 2**30, "val_acc": r["val_acc"]})
    print_table(rows)
    print_table([{k: v for k, v in r.items() if not isinstance(v, list)} for r in summary])


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bars: speedup over py, ratio to gpu_resident, CPU-time ratio, accuracy spread."""
    out = []
    for dsn, model in sorted({(r["dataset"], r["model"]) for r in results}):
        by = {r["way"]: r for r in results if r["dataset"] == dsn and r["model"] == model}
        d, py, res = by.get("datapath"), by.get("py"), by.get("gpu_resident")
        row: dict[str, Any] = {"dataset": dsn, "model": model}
        if d and py:
            row["speedup_vs_py"] = py["per_batch_s"] / d["per_batch_s"]
            row["cpu_ratio_vs_py"] = d["cpu_s_per_batch"] / py["cpu_s_per_batch"]
        for way, key in (("datapath", "ratio_vs_resident"), ("datapath_cache", "cache_ratio_vs_resident"),
                         ("datapath_disk", "disk_ratio_vs_resident")):
            x = by.get(way)
            if x and res:
                row[key] = x["per_batch_s"] / res["per_batch_s"]
                pairs = [a / b for a, b in zip(x["per_batch_s_rounds"], res["per_batch_s_rounds"])]
                row[f"{key}_per_round"] = pairs  # round i of each (they alternate): drift cancels
                row[f"{key}_median_of_rounds"] = sorted(pairs)[len(pairs) // 2]
        accs = [r["val_acc"] for r in by.values()]
        row["val_acc_spread"] = max(accs) - min(accs)
        if d and py:
            row["max_loss_diff"] = max((abs(a - b) for a, b in zip(d["losses"], py["losses"])), default=0.0)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
