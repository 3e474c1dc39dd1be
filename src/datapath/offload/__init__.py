"""Activation offloading (SSDTrain): saved activations go to pinned host memory or disk during
forward and come back, prefetched in reverse module order, before backward needs them.

    from datapath.offload import offload
    with offload(model, target="host" | "ssd" | "tiered", path="/nvme/act", policy="adaptive"):
        loss = model(batch).loss
        loss.backward()

`TensorCache` gives explicit control (attach/detach, micro-batch and backward
hints, `wait_io`, statistics); `plan_offload` is the adaptive planner.
"""
from datapath.offload.cache import TensorCache
from datapath.offload.context import offload
from datapath.offload.errors import OffloadConfigError, OffloadError
from datapath.offload.planner import OffloadPlan, StepProfile, plan_offload
from datapath.offload.stats import OffloadStats

__all__ = [
    "OffloadConfigError", "OffloadError", "OffloadPlan", "OffloadStats", "StepProfile", "TensorCache",
    "offload", "plan_offload",
]
