"""How a layer reads its inputs: ``x`` (num_src, F), a pair ``(x_src, x_dst)``, or a table with ``src_ids``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from datapath import memory
from datapath.ops import CSRView, DeviceMismatchError, FeatureShapeError, as_csr
from datapath.ops._inputs import check_ids, resolve_table


@dataclass
class LayerInputs:
    """The resolved inputs of a conv layer.

    ``x_src`` is (num_src, F) -- or, when ``src_ids`` is set, the feature table that the
    ops read through ``src_ids`` without materializing ``x_src``; ``x_dst`` is (num_dst, F).
    """

    csr: CSRView
    x_src: torch.Tensor
    x_dst: torch.Tensor
    src_ids: torch.Tensor | None

    @property
    def fused(self) -> bool:
        return self.src_ids is not None

    def materialized_src(self) -> torch.Tensor:
        """(num_src, F) source features on the compute device (gathered when fused)."""
        if self.src_ids is None:
            return self.x_src
        return gather_rows(self.x_src, self.src_ids)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` on ``ids``' device: a unified/pinned table is read zero-copy by the GPU."""
    resolve_table(table, ids)  # validates (pinned, contiguous, devices)
    if table.numel() == 0 or ids.numel() == 0:  # nothing to read (an empty table cannot even be pinned)
        return torch.empty((ids.numel(), *table.shape[1:]), dtype=table.dtype, device=ids.device)
    return memory.gather_rows(table, ids)


def _check_x(t: Any, width: int | None, csr: CSRView, what: str, on_graph_device: bool) -> None:
    """``t`` a tensor of ``width`` columns (when known) on the graph's device (``on_graph_device``)."""
    if not isinstance(t, torch.Tensor):
        raise FeatureShapeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise FeatureShapeError(f"{what} must be 2-D (rows, features), got shape {tuple(t.shape)}")
    if width is not None and t.shape[1] != width:
        raise FeatureShapeError(f"{what} has {t.shape[1]} features but the layer takes {width} (its in_channels)")
    if on_graph_device and t.device != csr.device:
        raise DeviceMismatchError(f"{what} is on {t.device} but the graph on {csr.device}; move {what} (or the "
                                  f"graph) with .to({str(csr.device)!r})")


def layer_inputs(graph: Any, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 src_ids: torch.Tensor | None = None,
                 in_channels: int | tuple[int | None, int | None] | None = None) -> LayerInputs:
    """Resolve ``x`` against ``graph`` (destinations are the first ``num_dst`` sources, DGL's block rule).

    ``in_channels``: the widths the layer takes (an int, a pair (source, destination) or None: unchecked); ``x``
    (a pair's tensors) must have them and live on the graph's device (a table read through ``src_ids`` may live in
    host memory) -- checked here, before a layer's first matmul, so that the error names the argument."""
    csr = as_csr(graph)
    if src_ids is None and isinstance(x, torch.Tensor):  # the common call, checked inline (it runs every step)
        width = in_channels[0] if isinstance(in_channels, tuple) else in_channels
        if x.dim() != 2 or (width is not None and x.shape[1] != width) or x.device != csr.indices.device:
            _check_x(x, width, csr, "x", True)  # raises, naming what is wrong
        nd = csr.num_dst
        if nd > csr.num_src:
            raise FeatureShapeError(
                f"the graph has more destination ({nd}) than source ({csr.num_src}) nodes, so x_dst "
                f"cannot be x[:num_dst]; pass x as a pair (x_src, x_dst)"
            )
        # a whole graph (every source is a destination): x itself, not a full-length slice, whose backward would
        # cost a zero-filled gradient and a copy
        return LayerInputs(csr, x, x if x.shape[0] == nd else x[:nd], None)
    w_src, w_dst = in_channels if isinstance(in_channels, tuple) else (in_channels, in_channels)
    if isinstance(x, tuple):
        if src_ids is not None:
            raise FeatureShapeError("pass either a pair (x_src, x_dst) or a table with src_ids, not both")
        if len(x) != 2:
            raise FeatureShapeError(f"x as a tuple must be (x_src, x_dst), got {len(x)} items")
        x_src, x_dst = x
        _check_x(x_src, w_src, csr, "x_src", True)
        _check_x(x_dst, w_dst, csr, "x_dst", True)
        if x_dst.shape[0] != csr.num_dst:
            raise FeatureShapeError(
                f"x_dst has {x_dst.shape[0]} rows but the graph has {csr.num_dst} destination nodes"
            )
        return LayerInputs(csr, x_src, x_dst, None)
    if src_ids is not None:
        _check_x(x, w_src, csr, "the feature table x", False)
        table = resolve_table(x, src_ids)
        ids = check_ids(src_ids, table.shape[0], csr.num_src, "src_ids")
        x_dst = gather_rows(x, ids[: csr.num_dst])
        return LayerInputs(csr, x, x_dst, ids)
    raise FeatureShapeError(f"x must be a torch.Tensor (or a pair (x_src, x_dst)), got {type(x).__name__}")
