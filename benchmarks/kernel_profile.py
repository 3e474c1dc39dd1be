"""Kernel profile (GPU): where a forward+backward of `aggregate` (and of a layer) spends its time.

A diagnostic beside B3 (`benchmarks/aggregate.py`): datapath against cuSPARSE with a prebuilt transpose (and
a `datapath.nn.SAGEConv` against PyG's): per step, the CUDA runtime/driver calls made on the host, the
kernels run on the GPU and their total time, from torch.profiler; public API only.  Run on the GPU machine:

    PYTHONPATH=src:. python benchmarks/kernel_profile.py
"""
from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._common import interleaved_ms
from benchmarks.aggregate import _PretransposedSpMM, csr_tensors
from datapath.ops import aggregate, plan_aggregation
from datapath.testing import edge_index, seed_graph

STEPS = 20


def summarize(label: str, fn) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    api: collections.Counter = collections.Counter()
    kern: collections.Counter = collections.Counter()
    kern_us = 0.0
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[name[:60]] += 1
            kern_us += e.device_time
        elif name.startswith(("cuda", "cu")) and not name.startswith("cudnn"):
            api[name] += 1
    print(f"  {label}: GPU kernel time {kern_us / STEPS:.1f} us/step")
    print("    host API/step: " + ", ".join(f"{k}={v / STEPS:.1f}" for k, v in api.most_common(12)))
    print("    kernels/step: " + ", ".join(f"{k}={v / STEPS:.1f}" for k, v in kern.most_common(8)))


def case(name: str, seed: int, f: int, dt: torch.dtype) -> None:
    g, _ = seed_graph(name, device="cuda", seed=seed)
    plan = plan_aggregation(g, f, dt, probe=True)
    a, at = csr_tensors(g, dt)
    x = torch.randn(g.num_src_nodes, f, device="cuda").to(dt).requires_grad_()
    gy = torch.randn(g.num_dst_nodes, f, device="cuda").to(dt)

    def dp() -> None:
        x.grad = None
        aggregate(g, x).backward(gy)

    def pret() -> None:
        x.grad = None
        _PretransposedSpMM.apply(x, a, at).backward(gy)

    def dp_f() -> None:
        with torch.no_grad():
            aggregate(g, x)

    def cs_f() -> None:
        with torch.no_grad():
            torch.sparse.mm(a, x)

    t = interleaved_ms({"dp_fb": dp, "pret_fb": pret}, reps=7)
    tf = interleaved_ms({"dp_f": dp_f, "cs_f": cs_f}, reps=7)
    print(f"{name} F={f} {dt} plan {plan.kernel}: {t} {tf}", flush=True)
    summarize("datapath fb", dp)
    summarize("pret fb", pret)


def layers() -> None:
    import torch_geometric.nn as pyg  # noqa: PLC0415

    from datapath.nn import SAGEConv  # noqa: PLC0415

    g, _ = seed_graph("citeseer", device="cuda")
    ei = edge_index(g)
    x = torch.randn(g.num_src_nodes, 128, device="cuda", requires_grad=True)
    gy = torch.randn(g.num_dst_nodes, 64, device="cuda")
    theirs = pyg.SAGEConv(128, 64).cuda()
    ours = SAGEConv(128, 64).cuda()
    ours.load_state_dict(theirs.state_dict(), strict=False)

    def fo() -> None:
        x.grad = None
        ours(g, x).backward(gy)

    def fp() -> None:
        x.grad = None
        theirs(x, ei).backward(gy)
    print("citeseer SAGEConv fb", interleaved_ms({"ours": fo, "pyg": fp}, reps=7), flush=True)
    summarize("ours", fo)
    summarize("pyg", fp)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("kernel_profile needs a CUDA GPU")
    case("ppi", 1, 128, torch.float32)
    case("soc-BlogCatalog", 5, 64, torch.float32)
    case("artist", 4, 16, torch.float16)
    layers()


if __name__ == "__main__":
    main()
