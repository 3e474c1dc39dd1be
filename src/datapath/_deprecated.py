"""Old import paths kept for one release (0.2): each resolves to the name's new home with a DeprecationWarning.

The one deprecation mechanism of datapath.  A module that lost names (or a whole module that
moved) defines its module-level ``__getattr__`` with `forward`::

    from datapath._deprecated import forward
    __getattr__ = forward(__name__)

and the old names and their new homes are listed here, in `MOVED` (name by name) or
`MOVED_MODULES` (every public name of a module).  The targets are strings, imported only when
an old name is used, so a package never imports the layers above it to forward to them.
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

_APPS_LAUNCH = ("DistContext", "all_gather_objects", "exit_if_stopped", "in_launched_job", "new_prefix",
                "shutdown_distributed", "stop_requested")
_APPS_SHARED = ("SharedDataset", "attach_dataset", "memory_footprint", "segment_bytes", "share_dataset")
_APPS_TRAIN = ("global_mean_loss", "make_optimizer", "wrap_ddp")
_APPS_TRAINING = ("EpochStats", "check_cuda_autograd", "profile_batches")
_APPS_MACHINE = ("cuda_available", "device_label", "require_cuda", "use_blocking_sync")


def _homes(module: str, names: tuple[str, ...]) -> dict[str, str]:
    return dict.fromkeys(names, module)


# The public names of datapath.apps and where each name of the old, wider face lives now.
_APPS = {
    **dict.fromkeys(("TrainConfig", "run_training", "train", "train_epoch", "evaluate", "launch", "init_distributed",
                     "shared_dataset", "machine_info", "DistributedError"), "datapath.apps"),
    **_homes("datapath.apps.launch", _APPS_LAUNCH),
    **_homes("datapath.apps.shared_data", _APPS_SHARED),
    **_homes("datapath.apps.train_gnn", _APPS_TRAIN),
    **_homes("datapath.apps.training", _APPS_TRAINING),
    **_homes("datapath.apps.machine", _APPS_MACHINE),
    "CudaAutogradUnavailableError": "datapath.apps.errors",
}

MOVED: dict[str, dict[str, str]] = {
    "datapath.loaders": {
        **{n: "datapath.graph" for n in (
            "Graph", "validate_csr", "InvalidGraphError", "DatasetError", "Dataset", "PRESETS", "SyntheticSpec",
            "generate", "get_dataset", "load_dataset", "papers_spec", "prepare_dataset", "preset_spec")},
        **{n: "datapath.sampling" for n in ("Block", "NeighborSampler")},
        **{n: _APPS[n] for n in (
            "EpochStats", "evaluate", "profile_batches", "train_epoch", "CudaAutogradUnavailableError",
            "DistContext", "DistributedError", "attach_dataset", "init_distributed", "launch", "memory_footprint",
            "share_dataset", "shared_dataset", "shutdown_distributed")},
    },
    "datapath.loaders.distributed": {
        **{n: _APPS[n] for n in (
            "DistContext", "DistributedError", "attach_dataset", "init_distributed", "launch", "memory_footprint",
            "share_dataset", "shared_dataset", "shutdown_distributed", "TrainConfig", "global_mean_loss",
            "wrap_ddp", "make_optimizer", "in_launched_job", "all_gather_objects", "new_prefix", "segment_bytes",
            "SharedDataset")},
        "run_training": "datapath.apps",
        "train_worker": "datapath.apps:train",
    },
    # the application face narrowed to what a user calls; the rest from its submodule
    "datapath.apps": {n: m for n, m in _APPS.items() if m != "datapath.apps"},
    # the feature store's face narrowed to what a user calls; disk internals from their submodules
    "datapath.features": {
        **_homes("datapath.features.scan", ("BOUNCE_BUFFERS", "BOUNCE_BYTES", "GAPS", "SCAN", "DiskCosts", "GapChoice",
                                            "ReadResult", "choose_gap", "probe_disk", "read_rows", "run_groups")),
        **_homes("datapath.features.disk", ("ENGINES", "DiskReader", "DiskTier", "ReadPlan", "native_aio_available",
                                            "plan_reads")),
        **_homes("datapath.features.hotness", ("rank",)),
        **_homes("datapath.features.placement", ("GPU_RESERVE_BYTES", "graph_bytes")),
        **_homes("datapath.features.sharded", ("CACHE_SCOPES", "ShardedTier")),
        **_homes("datapath.features.pending_gather", ("PendingGather",)),
        **_homes("datapath.features.superbatch", ("Schedule", "StagingPool")),
        **_homes("datapath.features.tiers", ("FetchTier", "TierStats")),
    },
    # workload modelling moved to datapath.analysis
    "datapath.offload": {
        **_homes("datapath.analysis.presets", ("PRESETS", "TransformerConfig", "Workload", "build_workload",
                                               "get_preset")),
        **_homes("datapath.analysis.rok", ("STRATEGIES", "RokError", "sweep")),
        **_homes("datapath.analysis.rok_result", ("RokPoint", "RokResult")),
        **_homes("datapath.analysis.ssd_plan", (
            "Drive", "GpuSpec", "Parallelism", "PlanError", "SsdPlan", "TransformerShape", "activation_breakdown",
            "activation_bytes_per_step", "model_flops_per_step", "plan")),
    },
}

MOVED_MODULES: dict[str, str] = {
    "datapath.loaders.graph": "datapath.graph",
    "datapath.loaders.datasets": "datapath.graph",
    "datapath.loaders.sampler": "datapath.sampling",
    "datapath.loaders.block": "datapath.sampling",
    "datapath.offload.presets": "datapath.analysis.presets",
    "datapath.offload.rok": "datapath.analysis.rok",
    "datapath.offload.ssd_plan": "datapath.analysis.ssd_plan",
}


def target_of(module: str, name: str) -> tuple[str, str] | None:
    """``(new_module, new_name)`` of the old ``module.name``, or None if it never lived there."""
    target = MOVED.get(module, {}).get(name)
    if target is None and module in MOVED_MODULES and not name.startswith("__"):
        target = MOVED_MODULES[module]
    if target is None:
        return None
    new_module, _, new_name = target.partition(":")
    return new_module, new_name or name


def forward(module: str) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``module``: an old name resolves to its new home, with a
    DeprecationWarning naming both paths; any other name raises AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        target = target_of(module, name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = target
        obj = getattr(importlib.import_module(new_module), new_name)
        warnings.warn(f"{module}.{name} moved to {new_module}.{new_name}; import it from there (the old path goes "
                      f"away in datapath 0.3)", DeprecationWarning, stacklevel=2)
        return obj

    return __getattr__
