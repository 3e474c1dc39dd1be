"""Train GraphSAGE on a graph whose features do not fit in GPU memory (nor, with --host-memory, in host memory).

The features stay in ``features.npy`` of a dataset directory.  A `FeatureStore` keeps the
hottest rows in a GPU cache, the next ones in pinned host memory, and reads the rest from
the file (O_DIRECT) while the GPU trains; the graph goes on the GPU when it fits beside
the cache, in pinned host memory otherwise.  The training loop is the ordinary one:

    feats = FeatureStore(directory / "features.npy", gpu_cache="25%", host_memory="25%", hotness=hot)
    loader = NeighborLoader(graph, train_idx, [15, 10, 5], 1024, features=feats, labels=labels)
    for batch in loader:
        loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)

    python examples/large_graph.py --preset papers --memory-gb 60 --directory /data/papers
    python examples/large_graph.py --preset tiny --device cpu          # seconds, on any machine
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from datapath.apps import evaluate, train_epoch
from datapath.features import FeatureStore, format_bytes, gpu_budget, parse_budget, place_graph, presample_hotness
from datapath.graph import load_dataset, prepare_dataset
from datapath.loaders import NeighborLoader
from datapath.memory import to_placement
from datapath.nn.models import build_model
from datapath.sampling import NeighborSampler


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", type=Path, default=None,
                   help="dataset directory (made with prepare-dataset; created from --preset if missing) "
                        "[./data/PRESET]")
    p.add_argument("--preset", default="tiny", help="preset written when the directory does not exist [tiny]")
    p.add_argument("--memory-gb", type=float, default=None, help="size of the papers preset (features + graph)")
    p.add_argument("--gpu-cache", default="25%", help="GPU cache of hot feature rows [25%%]")
    p.add_argument("--host-memory", default="25%", help="pinned host memory for feature rows; the rest is read "
                                                        "from disk [25%%]")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-batches", type=int, default=None, help="stop each epoch after this many batches")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    directory = args.directory or Path("data") / args.preset
    if not (directory / "meta.json").is_file():
        t0 = time.perf_counter()
        prepare_dataset(args.preset, directory, memory_gb=args.memory_gb, device=args.device, progress=False)
        print(f"wrote {args.preset} to {directory} ({time.perf_counter() - t0:.1f} s)")
    ds = load_dataset(directory)  # memory-mapped: nothing read yet
    device = torch.device(args.device)
    fanouts = [int(f) for f in args.fanouts.split(",")]
    feature_bytes = ds.features.numel() * ds.features.element_size()
    cache_bytes = parse_budget(args.gpu_cache, feature_bytes, "--gpu-cache") or 0
    graph = place_graph(ds.graph, gpu_budget(cache_bytes)) if device.type == "cuda" else ds.graph
    sampler = NeighborSampler(fanouts, seed=0)
    hot = presample_hotness(graph, ds.train_idx, sampler, batch_size=args.batch_size, batches=32)
    feats = FeatureStore(directory / "features.npy", gpu_cache=args.gpu_cache, host_memory=args.host_memory,
                         hotness=hot, device=device)
    labels = to_placement(ds.labels, "cuda" if device.type == "cuda" else "cpu")
    print(f"{ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges, {format_bytes(feature_bytes)} of features; "
          f"graph in {graph.placement} memory; store {feats.describe()}")
    model = build_model("sage", ds.num_features, 256, ds.num_classes, len(fanouts), dropout=0.3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = NeighborLoader(graph, ds.train_idx, sampler, args.batch_size, shuffle=True, features=feats,
                            labels=labels, device=device, prepare=model.prepare_batch)
    history = []
    for epoch in range(args.epochs):
        feats.reset_stats()
        st = train_epoch(model, loader, opt, max_batches=args.max_batches)
        tiers = feats.stats()
        history.append({"epoch": epoch, "loss": st.loss, "epoch_s": st.epoch_s, "batches": st.batches,
                        "tiers": tiers})
        print(f"epoch {epoch}: loss {st.loss:.4f}, {st.batches} batches in {st.epoch_s:.1f} s; rows from "
              + ", ".join(f"{k} {v['hit_rate']:.1%}" for k, v in tiers.items()))
    val = NeighborLoader(graph, ds.val_idx[:20_000], NeighborSampler(fanouts, seed=1), 4 * args.batch_size,
                         features=feats, labels=labels, device=device)
    acc = evaluate(model, val)
    print(f"validation accuracy {acc:.3f} (chance {1 / ds.num_classes:.3f})")
    feats.close()
    return {"history": history, "val_acc": acc, "num_classes": ds.num_classes}


if __name__ == "__main__":
    main()
