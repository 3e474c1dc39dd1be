"""Moved: `datapath.memory` decides where tensors live and fetches rows.  Kept for the loaders' imports."""
from __future__ import annotations

from typing import Any

from datapath.memory.placement import (  # noqa: F401 - re-exported
    PLACEMENTS, gather_rows, host_of, kernel_view, placement_of, to_placement,
)


def _ut() -> Any:
    import datapath.unified_tensor as ut  # noqa: PLC0415

    return ut
