"""Optional dependencies: imported where they are used, and a missing one named with its extra.

    plt = require("matplotlib.pyplot", extra="plot", purpose="--png")

raises, where matplotlib does not import, `MissingDependencyError` with one line::

    --png needs matplotlib, which is not installed: pip install "datapath[plot]"
"""
from __future__ import annotations

import importlib
from types import ModuleType

from datapath._runtime.errors import DatapathError

# the distribution that provides a top-level module, where the two names differ
_DISTRIBUTION = {"cupy": "cupy-cuda13x", "kvikio": "kvikio-cu13", "torch_geometric": "torch_geometric",
                 "sklearn": "scikit-learn", "yaml": "pyyaml"}


class MissingDependencyError(DatapathError, ImportError):
    """An optional package a feature needs does not import; the message names the extra that installs it."""


def require(module: str, extra: str, purpose: str | None = None) -> ModuleType:
    """Import ``module`` (dotted names allowed) or raise `MissingDependencyError` naming ``extra``.

    ``extra``: the ``datapath[...]`` extra that installs it (``"plot"``, ``"gpu"``, ``"hf"``,
    ``"lightning"``, ``"io"``, ``"pyg"``); ``purpose``: what needs it, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] not in (top, _DISTRIBUTION.get(top, top)):
            # the package is there but one of *its* imports failed: that is not a missing extra
            raise
        what = purpose or "this feature of datapath"
        dist = _DISTRIBUTION.get(top, top)
        raise MissingDependencyError(
            f'{what} needs {dist}, which is not installed: pip install "datapath[{extra}]"') from exc
