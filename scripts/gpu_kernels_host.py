"""Host cost of the nn layers on a small graph (citeseer shape), datapath vs PyG: where the time of a host-bound
forward+backward goes.  Prints host us per step (back-to-back, one sync at the end) and the top functions of a
cProfile of datapath's steps.  Run on the GPU machine: PYTHONPATH=src:. python scripts/gpu_kernels_host.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import torch_geometric.nn as pyg

from datapath.nn import GCNConv, GINConv, SAGEConv
from datapath.testing import seed_graph


def host_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    g, _ = seed_graph("citeseer", device="cuda")
    e = g.indices.numel()
    dst = torch.repeat_interleave(torch.arange(g.num_dst_nodes, device="cuda"), g.indptr[1:] - g.indptr[:-1],
                                  output_size=e)
    edge_index = torch.stack([g.indices.long(), dst])
    x = torch.randn(g.num_src_nodes, 128, device="cuda", requires_grad=True)
    gy = torch.randn(g.num_dst_nodes, 64, device="cuda")
    for kind, ours, theirs in (
        ("SAGEConv", SAGEConv(128, 64), pyg.SAGEConv(128, 64)),
        ("GCNConv", GCNConv(128, 64), pyg.GCNConv(128, 64, add_self_loops=False, cached=True)),
        ("GINConv", GINConv(torch.nn.Linear(128, 64)), pyg.GINConv(torch.nn.Linear(128, 64))),
    ):
        theirs, ours = theirs.cuda(), ours.cuda()
        ours.load_state_dict(theirs.state_dict(), strict=False)

        def fb_ours() -> None:
            x.grad = None
            ours(g, x).backward(gy)

        def fb_pyg() -> None:
            x.grad = None
            theirs(x, edge_index).backward(gy)

        def f_ours() -> None:
            with torch.no_grad():
                ours(g, x)

        def f_pyg() -> None:
            with torch.no_grad():
                theirs(x, edge_index)

        print(f"{kind}: host us/step fwd ours {host_us(f_ours):.1f} pyg {host_us(f_pyg):.1f}; "
              f"fb ours {host_us(fb_ours):.1f} pyg {host_us(fb_pyg):.1f}", flush=True)
    # where datapath's host time goes (SAGEConv fb)
    ours = SAGEConv(128, 64).cuda()

    def fb() -> None:
        x.grad = None
        ours(g, x).backward(gy)
    host_us(fb, 20)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        fb()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
