"""datapath: fast training when the data does not fit on the GPU.

Importing datapath makes ``t.to("unified")`` work (pinned host memory that GPU kernels
read directly over PCIe; see `datapath.unified_tensor`).  Subpackages:

- `datapath.memory`: where a tensor lives and the one row fetch (zero copy from host memory);
- `datapath.unified_tensor`: the unified tensor type, ``.to("unified")``, shared tables;
- `datapath.graph`: graphs (CSR), datasets; `datapath.sampling`: GPU neighbour sampling;
- `datapath.loaders`: ``NeighborLoader`` (sampling + feature fetch, prefetched);
- `datapath.ops` / `datapath.nn`: GNN aggregation kernels and layers;
- `datapath.offload`: activation offloading to pinned host memory or disk;
- `datapath.apps`: the ``datapath`` command's jobs (``train-gnn``, ``info``...).
"""
from __future__ import annotations

__version__ = "0.2.0.dev0"

from datapath import unified_tensor  # noqa: E402  (installs Tensor.to("unified"))
from datapath.unified_tensor import UnifiedTensor, as_unified, is_unified  # noqa: E402

__all__ = ["UnifiedTensor", "__version__", "as_unified", "is_unified", "unified_tensor"]
