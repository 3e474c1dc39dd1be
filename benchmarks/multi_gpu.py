"""Data-parallel GNN training over ONE shared host copy of the graph and features: 1 GPU vs N GPUs.

Setup (the products shape, GraphSAGE as B2): 3 layers, fanouts 15/10/5, hidden 256, dropout 0.5,
Adam 3e-3 (fused on the GPU), the aggregation schedules built in the loader's thread (``prepare``, as
``train-gnn`` and B2 do; ``--no-prepare``: in the training step, Adam unfused).  Each job (1 process, then N processes, spawned by `datapath.loaders.distributed.launch`)
generates the dataset on rank 0's GPU, shares graph, features, labels and splits ONCE in
``/dev/shm`` (`datapath.unified_tensor.share`); the other ranks attach and pin the same pages.
Every rank samples on its GPU from the shared graph and gathers its feature rows zero-copy
(``--placement gpu``: every rank copies graph, features and labels into its GPU first, so that no batch reads
over PCIe; the 1-GPU job alike).

Two batch modes, each a full epoch after ``--warmup`` untimed batches:

- ``weak`` (the bar): batch 1024 PER RANK (global batch N x 1024: the usual DDP setting, as in
  DistributedSampler and the DGL/PyG multi-GPU examples), so N ranks make 1/N of the steps;
- ``strong``: global batch 1024 (1024/N per rank): the same optimisation as one GPU.

Epoch time = the slowest rank's wall time for the epoch (ranks start together after a barrier);
seeds/s per rank and in all.  Host memory per rank (psutil memory_full_info: RSS, USS, PSS) and the
rank's resident/proportional share of the shared segment (/proc/self/smaps), and the segment size.

Contention, measured on the shared feature table: a zero-copy gather of random rows (the training
access pattern) and a pinned host-to-device copy (DMA) of a contiguous slice, each GPU alone (the
others wait at a barrier) and all GPUs at once; GB/s per GPU.

    PYTHONPATH=src:. python benchmarks/multi_gpu.py            # products, 1 vs 2 GPUs
    PYTHONPATH=src:. python benchmarks/multi_gpu.py --quick    # 1/20 of products, < 1 minute (CPU: gloo)
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import time
from typing import Any

import torch

from benchmarks._common import RESULTS_DIR, print_table, seconds_per_call, write_result
from datapath.apps import init_distributed, launch, shared_dataset, train_epoch
from datapath.apps.launch import all_gather_objects, DistContext
from datapath.apps.shared_data import memory_footprint
from datapath.apps.train_gnn import global_mean_loss, wrap_ddp
from datapath.graph import SyntheticSpec, generate, preset_spec
from datapath.loaders import DistributedNeighborLoader
from datapath.sampling import NeighborSampler
from datapath.nn.models import build_model
from datapath.unified_tensor import shm_dir

log = logging.getLogger("datapath.bench.multi_gpu")
BAR = 0.6
"""weak: N GPUs <= BAR x the 1-GPU epoch with one host copy."""
STRONG_BAR = 0.55
"""strong (the same global batch as 1 GPU): N GPUs <= STRONG_BAR x the 1-GPU epoch (issue 39's bar at N = 2)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1/20 of the products shape, few batches (< 1 minute)")
    p.add_argument("--gpus", type=int, default=None, help="the N of 1 vs N [2; or all GPUs if fewer]")
    p.add_argument("--dataset", default="products")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank in the weak mode; global in strong [1024]")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="untimed batches before each timed epoch [8; quick 2]")
    p.add_argument("--max-batches", type=int, default=None,
                   help="cut each timed epoch to this many steps per rank [full epoch; quick 6]")
    p.add_argument("--modes", default="weak,strong")
    p.add_argument("--no-prepare", action="store_true",
                   help="build the aggregation schedules in the training step, not in the loader's thread "
                        "(`prepare=model.prepare_batch`, what `train-gnn` and B2 do), and Adam unfused")
    p.add_argument("--placement", choices=("shared", "gpu"), default="shared",
                   help="shared: every rank samples and gathers zero-copy from the one host copy; gpu: every rank "
                        "copies the graph, features and labels into its GPU first (B2's GPU-resident way: nothing "
                        "crosses PCIe a batch) [shared]")
    p.add_argument("--bw-rows", type=int, default=1 << 19, help="rows per gather in the contention test")
    p.add_argument("--bw-copy-mb", type=int, default=512, help="MB per DMA copy in the contention test")
    p.add_argument("--bw-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="multi_gpu")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    have = torch.cuda.device_count() if cuda else 2
    args.gpus = args.gpus or min(2, have)
    if cuda and args.gpus > have:
        p.error(f"--gpus {args.gpus} but there are {have} GPUs")
    if args.placement == "gpu" and not cuda:
        p.error("--placement gpu needs CUDA GPUs (torch.cuda.is_available() is False here); use --placement shared")
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 8)
    if args.quick and args.max_batches is None:
        args.max_batches = 6
    if args.quick:
        args.bw_rows, args.bw_copy_mb, args.bw_iters = 1 << 16, 64, 5
    return args


def dataset_spec(args: argparse.Namespace) -> SyntheticSpec:
    spec = preset_spec(args.dataset, seed=args.seed)
    if args.quick:
        spec = dataclasses.replace(spec, name=f"{spec.name}-quick", num_nodes=max(spec.num_nodes // 20, 10_000),
                                   num_edges=max(spec.num_edges // 20, 100_000))
    return spec


# -- on every rank -----------------------------------------------------------------------------
def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _timed(ctx: DistContext, fn: Any, iters: int) -> float:
    """Seconds per call of ``fn`` (CUDA events; wall clock on the CPU)."""
    fn()
    _sync(ctx)
    return seconds_per_call(fn, iters, ctx.device.type == "cuda")


def contention(ctx: DistContext, feats: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """GB/s per GPU of a random-row gather and of a DMA copy from the shared table: alone, then all at once."""
    from datapath.memory import gather_rows  # noqa: PLC0415

    dev = ctx.device
    n, row_bytes = feats.shape[0], feats.shape[1] * feats.element_size()
    g = torch.Generator(device=dev).manual_seed(1234 + ctx.rank)
    idx = torch.randint(0, n, (args.bw_rows,), device=dev, generator=g)
    rows = min(n, args.bw_copy_mb * 2**20 // row_bytes)
    lo = (ctx.rank * rows) % max(n - rows, 1)
    src = feats[lo:lo + rows]
    dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
    tests = {
        "gather": (lambda: gather_rows(feats, idx), args.bw_rows * row_bytes),
        "dma_copy": (lambda: dst.copy_(src, non_blocking=True), rows * row_bytes),
    }
    out: dict[str, Any] = {}
    for name, (fn, nbytes) in tests.items():
        alone = None
        for r in range(ctx.world_size):
            ctx.barrier()
            if r == ctx.rank:
                alone = nbytes / _timed(ctx, fn, args.bw_iters) / 1e9
            ctx.barrier()
        ctx.barrier()
        together = nbytes / _timed(ctx, fn, args.bw_iters) / 1e9
        ctx.barrier()
        out[name] = {"alone_GBps": alone, "together_GBps": together, "bytes_per_call": nbytes}
    return out


def bench_worker(args: argparse.Namespace, spec: SyntheticSpec) -> dict[str, Any]:
    ctx = init_distributed()
    dev = ctx.device
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    res: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "device": str(dev)}
    t0 = time.perf_counter()
    res["memory_start"] = memory_footprint()

    def make() -> Any:
        ds = generate(spec, device=dev, progress=False)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return ds

    ds = shared_dataset(ctx, make)
    res["setup_s"] = time.perf_counter() - t0
    res["memory_after_share"] = memory_footprint(ds.prefix)
    fanouts = [int(f) for f in args.fanouts.split(",")]
    graph, feats, labels = ds.graph, ds.features, ds.labels
    if args.placement == "gpu":  # a copy on every GPU: no PCIe reads a batch (the host copy stays shared)
        graph, feats, labels = graph.to("cuda"), feats.to(dev), labels.to(dev)
    res["placement"] = args.placement
    res["modes"] = {}
    for mode in args.modes.split(","):
        per_rank = args.batch_size if mode == "weak" else max(1, args.batch_size // ctx.world_size)
        torch.manual_seed(args.seed)
        net = build_model("sage", ds.num_features, args.hidden, ds.num_classes, len(fanouts), dropout=0.5).to(dev)
        # as `train-gnn` does: the aggregation schedules are built in the loader's thread
        prepare = None if args.no_prepare else net.prepare_batch
        loader = DistributedNeighborLoader(graph, ds.train_idx, NeighborSampler(fanouts, seed=args.seed),
                                           per_rank, shuffle=True, rank=ctx.rank, world_size=ctx.world_size,
                                           features=feats, labels=labels, device=dev, seed=args.seed,
                                           prepare=prepare)
        model = wrap_ddp(net, ctx)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=dev.type == "cuda" and not args.no_prepare)
        loss_fn = global_mean_loss(ctx.world_size)
        warm = train_epoch(model, loader, opt, max_batches=args.warmup, loss_fn=loss_fn)
        ctx.barrier()
        st = train_epoch(model, loader, opt, max_batches=args.max_batches, loss_fn=loss_fn)
        ctx.barrier()
        seeds = loader.seeds_in(st.batches)
        row = st.as_dict()
        row.pop("losses")
        res["modes"][mode] = {**row, "seeds": seeds, "seeds_per_s": seeds / st.epoch_s, "rank_batch": per_rank,
                              "global_batch": per_rank * ctx.world_size, "steps_per_epoch": len(loader),
                              "warmup_batches": warm.batches, "full_epoch": st.batches == len(loader),
                              "per_step_s": st.epoch_s / max(st.batches, 1)}
        del model, net, opt, loader
    res["memory_after_train"] = memory_footprint(ds.prefix)
    res["contention"] = contention(ctx, ds.features, args) if dev.type == "cuda" else None
    res["all_ranks_seen"] = len(all_gather_objects(ctx, ctx.rank))
    ctx.barrier()
    return res


# -- parent --------------------------------------------------------------------------------------
def _segment_need(spec: SyntheticSpec) -> int:
    return int(spec.num_nodes * (spec.num_features * 4 + 8 + 8 + 8) + 2.2 * spec.num_edges * 4)


def check_shm(spec: SyntheticSpec) -> dict[str, Any]:
    """Where the tables go, and whether they fit: one copy needs a RAM-backed directory (tmpfs).

    A directory on disk would not do: Linux does not let a GPU pin a disk file's pages
    in place, so every rank would pin a private copy (`datapath.unified_tensor.as_unified`).
    """
    d = shm_dir()
    need = _segment_need(spec)
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        free = 0
    if free < 1.2 * need:
        raise SystemExit(f"{d} has {free / 2**30:.2f} GiB free but the shared tables need about "
                         f"{need / 2**30:.2f} GiB: enlarge it (docker --shm-size) or set DATAPATH_SHM_DIR to a "
                         f"larger tmpfs")
    return {"dir": str(d), "free_bytes": free, "needed_estimate": need}


def summarize(jobs: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}}
    for mode in args.modes.split(","):
        per = {}
        for world, ranks in jobs.items():
            rows = [r["modes"][mode] for r in ranks]
            epoch_s = max(r["epoch_s"] for r in rows)
            steps = rows[0]["batches"]
            full_steps = rows[0]["steps_per_epoch"]
            per[world] = {"epoch_s": epoch_s, "steps": steps, "steps_per_epoch": full_steps,
                          "epoch_s_full": epoch_s / steps * full_steps,
                          "seeds_per_s": sum(r["seeds"] for r in rows) / epoch_s,
                          "seeds_per_s_per_rank": [r["seeds_per_s"] for r in rows],
                          "epoch_s_per_rank": [r["epoch_s"] for r in rows],
                          "global_batch": rows[0]["global_batch"]}
        n = max(jobs)
        ratio = per[n]["epoch_s_full"] / per[1]["epoch_s_full"]
        out["modes"][mode] = {"jobs": per, "ratio_N_over_1": ratio, "speedup": 1 / ratio,
                              "bar_met": ratio <= (BAR if mode == "weak" else STRONG_BAR)}
    mem = {}
    for world, ranks in jobs.items():
        seg = ranks[0]["memory_after_train"]["segment"]
        mem[world] = {"segment_bytes": seg["nbytes"], "segment_allocated": seg["allocated"],
                      "tables": seg["tables"],
                      "one_copy": all(r["memory_after_train"]["shared_mappings"] == seg["tables"] for r in ranks),
                      "ranks": [{k: r["memory_after_train"][k] for k in
                                 ("rss", "uss", "pss", "shared_rss", "shared_pss", "shared_mapped")} for r in ranks]}
    out["memory"] = mem
    n = max(jobs)
    weak = out["modes"].get("weak")
    if weak is not None:  # the bar: N GPUs <= 0.6 x one GPU, with ONE copy of the data in host memory
        weak["bar_met"] = bool(weak["ratio_N_over_1"] <= BAR and mem[n]["one_copy"] and mem[n]["tables"] > 0)
    if jobs[n][0]["contention"] is not None:
        cont = {}
        for test in ("gather", "dma_copy"):
            alone = [r["contention"][test]["alone_GBps"] for r in jobs[n]]
            together = [r["contention"][test]["together_GBps"] for r in jobs[n]]
            cont[test] = {"alone_GBps": alone, "together_GBps": together, "sum_alone": sum(alone),
                          "sum_together": sum(together), "together_over_alone": sum(together) / sum(alone)}
        out["contention"] = cont
    return out


def plot(summary: dict[str, Any], path: Any, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    ax = axes[0]
    modes = list(summary["modes"])
    for i, mode in enumerate(modes):
        m = summary["modes"][mode]
        t1, tn = m["jobs"][1]["epoch_s_full"], m["jobs"][n]["epoch_s_full"]
        ax.bar([3 * i, 3 * i + 1], [t1, tn], color=["#8c8c8c", "#1f77b4"], width=0.8)
        ax.text(3 * i + 1, tn, f"{tn / t1:.2f}x", ha="center", va="bottom", fontsize=8)
        bar = BAR if mode == "weak" else STRONG_BAR
        ax.plot([3 * i + 0.6, 3 * i + 1.4], [bar * t1] * 2, "r--", lw=1.5, label=f"{mode} bar {bar} x 1 GPU")
    ax.set_xticks([3 * i + d for i in range(len(modes)) for d in (0, 1)],
                  [f"{mode}\n{w} GPU" for mode in modes for w in (1, n)], fontsize=8)
    ax.set_ylabel("epoch time (s)")
    ax.set_title("epoch time (slowest rank)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    mem = summary["memory"][n]
    labels = [f"rank {r}" for r in range(len(mem["ranks"]))]
    shared = [m["shared_rss"] / 2**30 for m in mem["ranks"]]
    other = [(m["rss"] - m["shared_rss"]) / 2**30 for m in mem["ranks"]]
    ax.bar(labels, other, color="#8c8c8c", label="RSS outside the segment")
    ax.bar(labels, shared, bottom=other, color="#2ca02c", label="shared segment (resident, same pages)")
    ax.scatter(labels, [m["pss"] / 2**30 for m in mem["ranks"]], color="k", zorder=3, label="PSS")
    ax.axhline(mem["segment_bytes"] / 2**30, color="#2ca02c", ls="--", lw=1, label="segment size (one copy)")
    ax.set_ylabel("GiB")
    ax.set_title(f"host memory per rank ({n} GPUs)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    cont = summary.get("contention")
    if cont:
        tests = list(cont)
        for i, t in enumerate(tests):
            ax.bar([3 * i, 3 * i + 1], [cont[t]["sum_alone"], cont[t]["sum_together"]],
                   color=["#8c8c8c", "#d62728"], width=0.8)
            ax.text(3 * i + 1, cont[t]["sum_together"], f"{cont[t]['together_over_alone']:.2f}x", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks([3 * i + d for i in range(len(tests)) for d in (0, 1)],
                      [f"{t}\n{w}" for t in tests for w in ("sum alone", "at once")], fontsize=8)
        ax.set_ylabel("GB/s (all GPUs)")
        ax.set_title("host-memory/PCIe contention (shared table)", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no CUDA: contention not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.suptitle(f"data parallel over one shared copy: 1 vs {n} GPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse()
    cuda = torch.cuda.is_available()
    if not cuda:
        log.warning("no CUDA: %d CPU processes with gloo (a smoke test of the code, not the benchmark)", args.gpus)
    spec = dataset_spec(args)
    shm = check_shm(spec)
    t_start = time.perf_counter()
    jobs: dict[int, list[dict[str, Any]]] = {}
    for world in sorted({1, args.gpus}):
        t0 = time.perf_counter()
        jobs[world] = launch(bench_worker, world, (args, spec))
        print(f"{world} process(es): done in {time.perf_counter() - t0:.1f} s", flush=True)
        write_result(args.name, {"partial": True, "jobs": jobs})
    summary = summarize(jobs, args)
    payload = {
        "description": f"data-parallel GraphSAGE on one shared host copy of {spec.name}: 1 vs {args.gpus} GPUs",
        "config": vars(args), "spec": dataclasses.asdict(spec), "shm": shm, "bar": BAR, "strong_bar": STRONG_BAR,
        "notes": {
            "weak": "batch_size seeds per rank (global = N x batch_size); the bar's mode",
            "strong": "global batch = batch_size (batch_size/N per rank)",
            "epoch_s": "slowest rank's wall time of the timed epoch (after warm-up batches); epoch_s_full "
                       "scales it to the full epoch when --max-batches cut it",
            "memory": "psutil memory_full_info per rank; shared_rss/shared_pss = the rank's resident/proportional "
                      "bytes of its mappings of the shared tables (/proc/self/smaps)",
            "contention": "each GPU alone (others at a barrier) vs all at once, on the shared feature table",
        },
        "jobs": {str(k): v for k, v in jobs.items()}, "summary": summary,
        "total_s": time.perf_counter() - t_start,
    }
    path = write_result(args.name, payload)
    plot(summary, RESULTS_DIR / f"{args.name}.png", args.gpus)
    print(f"wrote {path}")
    n = args.gpus
    rows = []
    for mode, m in summary["modes"].items():
        for world in sorted(m["jobs"]):
            j = m["jobs"][world]
            rows.append({"mode": mode, "gpus": world, "global_batch": j["global_batch"], "steps": j["steps"],
                         "epoch_s": j["epoch_s_full"], "seeds/s": j["seeds_per_s"],
                         "per_rank": "/".join(f"{v:.0f}" for v in j["seeds_per_s_per_rank"]),
                         f"{n}/1": m["ratio_N_over_1"] if world == n else "",
                         "bar": ("met" if m["bar_met"] else "MISSED") if (world == n and m["bar_met"] is not None)
                         else ""})
    print_table(rows)
    mrows = []
    for world, mem in summary["memory"].items():
        for r, m in enumerate(mem["ranks"]):
            mrows.append({"gpus": world, "rank": r, "RSS_GiB": m["rss"] / 2**30, "USS_GiB": m["uss"] / 2**30,
                          "PSS_GiB": m["pss"] / 2**30, "seg_RSS_GiB": m["shared_rss"] / 2**30,
                          "seg_PSS_GiB": m["shared_pss"] / 2**30, "segment_GiB": mem["segment_bytes"] / 2**30,
                          "one_copy": mem["one_copy"]})
    print_table(mrows)
    if "contention" in summary:
        print_table([{"test": t, **{f"alone_gpu{i}": v for i, v in enumerate(c["alone_GBps"])},
                      **{f"together_gpu{i}": v for i, v in enumerate(c["together_GBps"])},
                      "together/alone": c["together_over_alone"]} for t, c in summary["contention"].items()])


if __name__ == "__main__":
    main()
