"""Old import paths kept for one release (0.2): each resolves to the name's new home with a DeprecationWarning.

The forwarding lives here, outside the packages it serves, so that `datapath.loaders`
never imports the layers above it (`datapath.apps`, `datapath.nn`) itself.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any

MOVED: dict[str, dict[str, str]] = {
    "datapath.loaders": {
        **{n: "datapath.graph" for n in (
            "Graph", "validate_csr", "InvalidGraphError", "DatasetError", "Dataset", "PRESETS", "SyntheticSpec",
            "generate", "get_dataset", "load_dataset", "papers_spec", "prepare_dataset", "preset_spec")},
        **{n: "datapath.sampling" for n in ("Block", "NeighborSampler")},
        **{n: "datapath.apps" for n in (
            "EpochStats", "evaluate", "profile_batches", "train_epoch", "CudaAutogradUnavailableError",
            "DistContext", "DistributedError", "attach_dataset", "init_distributed", "launch", "memory_footprint",
            "share_dataset", "shared_dataset", "shutdown_distributed")},
    },
    "datapath.loaders.distributed": {
        **{n: "datapath.apps" for n in (
            "DistContext", "DistributedError", "attach_dataset", "init_distributed", "launch", "memory_footprint",
            "share_dataset", "shared_dataset", "shutdown_distributed", "TrainConfig", "global_mean_loss",
            "wrap_ddp", "make_optimizer", "in_launched_job", "all_gather_objects", "new_prefix", "segment_bytes",
            "SharedDataset")},
        "run_training": "datapath.apps",
        "train_worker": "datapath.apps:train",
    },
}


def moved(module: str, name: str) -> Any:
    """The object formerly at ``module.name``, with a DeprecationWarning; AttributeError if unknown."""
    target = MOVED.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, _, new_name = target.partition(":")
    new_name = new_name or name
    warnings.warn(f"{module}.{name} moved to {new_module}.{new_name}; the old path goes away in datapath 0.3",
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new_module), new_name)


def moved_module(module: str, new_module: str, name: str) -> Any:
    """``name`` from ``new_module``, for a whole module that moved there (warns once per access)."""
    if name.startswith("__"):
        raise AttributeError(name)
    obj = getattr(importlib.import_module(new_module), name)
    warnings.warn(f"{module} moved to {new_module}; import {name} from there (the old path goes away in "
                  f"datapath 0.3)", DeprecationWarning, stacklevel=3)
    return obj
