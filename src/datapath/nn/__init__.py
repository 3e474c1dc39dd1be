"""GNN layers on `datapath.ops`: ``SAGEConv``, ``GCNConv``, ``GINConv``, ``GATConv``; models built on them.

Each layer takes a graph or a sampled block (a CSR of destination rows; destinations are the
first ``num_dst_nodes`` sources) and features ``x`` (num_src, F), or ``(x_src, x_dst)``,
or a unified feature table with ``src_ids`` (the fused first-layer path), and returns
(num_dst, F_out).  Parameter names follow PyG, so state dicts carry over.  No layer
synchronises with the host in its forward or backward pass.

Models: `GraphSAGE` and `GAT` over sampled blocks (`build_model`, the training app's), and
the full-graph `GCN` and `GIN` of the seed papers' experiment (`build_full_graph_model`).
"""
from datapath.nn.full_graph import GCN, GIN, build_full_graph_model
from datapath.nn.gat_conv import GATConv
from datapath.nn.gcn_conv import GCNConv
from datapath.nn.gin_conv import GINConv
from datapath.nn.hetero_models import HeteroGNN
from datapath.nn.hgt_conv import HGTConv
from datapath.nn.models import GAT, GraphSAGE, build_model
from datapath.nn.rgat_conv import RGATConv
from datapath.nn.rgcn_conv import RGCNConv
from datapath.nn.sage_conv import SAGEConv

__all__ = [
    "GAT", "GATConv", "GCN", "GCNConv", "GIN", "GINConv", "GraphSAGE", "HGTConv", "HeteroGNN", "RGATConv", "RGCNConv", "SAGEConv",
    "build_full_graph_model", "build_model",
]
