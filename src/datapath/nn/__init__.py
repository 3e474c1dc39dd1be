"""GNN layers on `datapath.ops`: ``SAGEConv``, ``GCNConv``, ``GINConv``, ``GATConv``.

Each takes a graph or a sampled block (a CSR of destination rows; destinations are the
first ``num_dst_nodes`` sources) and features ``x`` (num_src, F), or ``(x_src, x_dst)``,
or a unified feature table with ``src_ids`` (the fused first-layer path), and returns
(num_dst, F_out).  Parameter names follow PyG, so state dicts carry over.
"""
from datapath.nn.gat_conv import GATConv
from datapath.nn.gcn_conv import GCNConv
from datapath.nn.gin_conv import GINConv
from datapath.nn.sage_conv import SAGEConv

__all__ = ["GATConv", "GCNConv", "GINConv", "SAGEConv"]
