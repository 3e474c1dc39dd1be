"""Activation offloading (SSDTrain): saved activations go to pinned host memory or disk during
forward and come back, prefetched in reverse module order, before backward needs them.

    from datapath.offload import offload
    with offload(model, target="host" | "ssd" | "tiered", path="/nvme/act", policy="adaptive"):
        loss = model(batch).loss
        loss.backward()

`TensorCache` gives explicit control (attach/detach, micro-batch and backward
hints, `wait_io`, statistics); `plan_offload` is the adaptive planner.  `sweep`
(module `rok`) measures the recompute-offload-keep curve of a model; `plan`
(module `ssd_plan`) is SSDTrain's bandwidth and SSD-lifespan model.
"""
from datapath.offload.cache import TensorCache
from datapath.offload.context import offload
from datapath.offload.distributed import clean_stale_ranks, offload_rank, rank_path
from datapath.offload.errors import OffloadConfigError, OffloadError
from datapath.offload.planner import OffloadPlan, StepProfile, plan_offload
from datapath.offload.presets import PRESETS, TransformerConfig, Workload, build_workload, get_preset
from datapath.offload.rok import STRATEGIES, RokError, RokPoint, RokResult, sweep
from datapath.offload.ssd_plan import (
    Drive, GpuSpec, Parallelism, PlanError, SsdPlan, TransformerShape, activation_breakdown,
    activation_bytes_per_step, model_flops_per_step, plan,
)
from datapath.offload.stats import OffloadStats

__all__ = [
    "PRESETS", "STRATEGIES", "Drive", "GpuSpec", "OffloadConfigError", "OffloadError", "OffloadPlan",
    "OffloadStats", "Parallelism", "PlanError", "RokError", "RokPoint", "RokResult", "SsdPlan", "StepProfile",
    "TensorCache", "TransformerConfig", "TransformerShape", "Workload", "activation_breakdown",
    "activation_bytes_per_step", "build_workload", "clean_stale_ranks", "get_preset", "model_flops_per_step",
    "offload", "offload_rank", "plan", "plan_offload", "rank_path", "sweep",
]
