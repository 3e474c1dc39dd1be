"""Graphs: the CSR protocol, `Graph` (a CSR in cpu, unified or cuda memory) and node-classification datasets.

    from datapath.graph import Graph, load_dataset
    graph = Graph.load("/data/products").to("unified")   # CSR pinned in host memory, read by the GPU
    ds = load_dataset("/data/products")                   # graph, features, labels, splits (memory-mapped)
    ds = Dataset.from_pyg(data)                           # or Graph.from_pyg(data); files: import_dataset

`datapath.graph.synthetic` generates power-law graphs with learnable labels shaped like
the seed datasets (``tiny``, ``reddit``, ``products``, ``papers``).
"""
from datapath.graph.csr import CSR, CSRGraph
from datapath.graph.datasets import Dataset, load_dataset
from datapath.graph.errors import DatasetError, InvalidGraphError
from datapath.graph.feature_shards import ShardLayout, shard_file
from datapath.graph.graph import Graph, validate_csr
from datapath.graph.external_sort import CSRFiles, edges_to_csr
from datapath.graph.hetero import EdgeType, HeteroGraph, HeteroGraphError
from datapath.graph.hetero_synthetic import HETERO_PRESETS, HeteroData, HeteroSpec, generate_hetero, is_hetero_dataset
from datapath.graph.importers import KINDS as IMPORT_KINDS, import_dataset
from datapath.graph.presets import get_dataset, prepare_dataset
from datapath.graph.reordering import METHODS as REORDER_METHODS, permute, reorder, window_locality
from datapath.graph.synthetic import PRESETS, SyntheticSpec, generate, papers_spec, preset_spec

__all__ = [
    "CSR", "CSRGraph", "Dataset", "DatasetError", "EdgeType", "Graph", "HeteroGraph", "HeteroGraphError", "InvalidGraphError", "PRESETS", "REORDER_METHODS",
    "ShardLayout", "SyntheticSpec", "generate", "get_dataset", "load_dataset", "papers_spec", "permute",
    "prepare_dataset", "preset_spec", "reorder", "shard_file", "validate_csr", "window_locality",
    "CSRFiles", "IMPORT_KINDS", "edges_to_csr", "import_dataset",
    "HETERO_PRESETS", "HeteroData", "HeteroSpec", "generate_hetero", "is_hetero_dataset",
]
