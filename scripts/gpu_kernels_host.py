"""Host cost of the nn layers on a small graph (citeseer shape), datapath vs PyG: where the time of a host-bound
forward+backward goes.  Prints host us per step (back-to-back, one sync at the end) and the top functions of a
cProfile of datapath's steps.  Run on the GPU machine: PYTHONPATH=src:. python scripts/gpu_kernels_host.py
"""
from __future__ import annotations

import cProfile
import io
import pstats

import torch
import torch_geometric.nn as pyg

from benchmarks._common import wall_us_per_call
from datapath.nn import GCNConv, GINConv, SAGEConv
from datapath.testing import edge_index, seed_graph


def main() -> None:
    g, _ = seed_graph("citeseer", device="cuda")
    ei = edge_index(g)
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
            theirs(x, ei).backward(gy)

        def f_ours() -> None:
            with torch.no_grad():
                ours(g, x)

        def f_pyg() -> None:
            with torch.no_grad():
                theirs(x, ei)

        print(f"{kind}: host us/step fwd ours {wall_us_per_call(f_ours):.1f} pyg {wall_us_per_call(f_pyg):.1f}; "
              f"fb ours {wall_us_per_call(fb_ours):.1f} pyg {wall_us_per_call(fb_pyg):.1f}", flush=True)
    # where datapath's host time goes (SAGEConv fb)
    ours = SAGEConv(128, 64).cuda()

    def fb() -> None:
        x.grad = None
        ours(g, x).backward(gy)
    wall_us_per_call(fb, 20)
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
