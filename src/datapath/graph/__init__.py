"""Graphs: the CSR protocol, `Graph` storage and datasets."""
from datapath.graph.csr import CSR, CSRGraph

__all__ = ["CSR", "CSRGraph"]
