"""datapath: fast training when the data does not fit on the GPU.

Importing datapath registers the ``"unified"`` device (pinned host memory that GPU
kernels read directly over PCIe).  Subpackages:

- `datapath.unified_tensor`: ``t.to("unified")``, zero-copy GPU gathers;
- `datapath.offload`: activation offloading to pinned host memory or NVMe;
- `datapath.loaders`: graphs, GPU neighbor sampling, ``NeighborLoader``;
- `datapath.ops` / `datapath.nn`: GNN aggregation kernels and layers.
"""
from __future__ import annotations

__version__ = "0.1.0"

from datapath import unified_tensor  # noqa: E402  (registers the "unified" device)
from datapath.unified_tensor import UnifiedTensor, as_unified, is_unified  # noqa: E402

__all__ = ["UnifiedTensor", "__version__", "as_unified", "is_unified", "unified_tensor"]
