"""Deprecated module path: ``datapath.loaders.datasets`` moved to `datapath.graph`; kept for one release."""
from typing import Any


def __getattr__(name: str) -> Any:
    from datapath._deprecated import moved_module  # noqa: PLC0415

    return moved_module(__name__, "datapath.graph", name)
