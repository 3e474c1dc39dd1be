"""Activation offloading: saved activations leave device memory in forward and come back, prefetched
in reverse module order, before backward needs them; within a memory budget, each is kept, offloaded
or recomputed, whichever fits fastest.

    from datapath.offload import offload
    with offload(model, memory_budget="10GB"):                      # or "12GiB", 0.5 (of the GPU)
        loss = model(batch).loss
        loss.backward()
    with offload(model, target="ssd", path="/nvme/act"):            # everything to disk ("host", "tiered")
        ...

`TensorCache` gives explicit control (attach/detach, micro-batch and backward hints,
`wait_io`, statistics); `OffloadConfig` holds its settings; `plan_budget` (with `checkpoint_plan` and
`recompute_plan`) and `plan_offload` are the budget and adaptive planners; `HostStore`, `FileStore` and
`TieredStore` implement the one `Store` interface (`AttentionStore` puts recomputed blocks' attention outputs in
one; `set_recompute` recomputes blocks, keeping or offloading those outputs); `auto_blocks` names the blocks of a
model (the units of ``units="blocks"``, what ``compile=True`` compiles one by one).  Workload modelling (ROK curves,
the SSD plan, presets) lives in `datapath.analysis`.
"""
from datapath._deprecated import forward
from datapath.offload.attention_offload import AttentionStore
from datapath.offload.attention_saved import AttentionCosts, attention_saved_contexts
from datapath.offload.budget_planner import (
    BudgetPlan, BudgetProfile, SegmentCost, checkpoint_plan, plan_budget, recompute_plan)
from datapath.offload.cache import TensorCache
from datapath.offload.cheap_recompute import is_cheap, set_cheap_recompute
from datapath.offload.config import FlowOptions, OffloadConfig, SelectOptions, StoreOptions, parse_memory_budget
from datapath.offload.context import offload
from datapath.offload.distributed import clean_stale_ranks, offload_rank, rank_path
from datapath.offload.errors import OffloadConfigError, OffloadError, OffloadWarning
from datapath.offload.file_store import FileStore
from datapath.offload.host_store import HostStore
from datapath.offload.integrations import patch_schedules, restore_patches
from datapath.offload.planner import OffloadPlan, SegmentProfile, StepProfile, TensorProfile, plan_offload
from datapath.offload.recompute import set_recompute
from datapath.offload.regional_compile import compile_blocks, uncompile_blocks
from datapath.offload.models import auto_blocks
from datapath.offload.spill_dir import SpillDir, clean_stale, reclaim_stale
from datapath.offload.stats import OffloadStats
from datapath.offload.store import Slot, Store, Streams
from datapath.offload.tiered_store import TieredStore

__all__ = [
    "AttentionCosts", "AttentionStore", "BudgetPlan", "BudgetProfile", "FileStore", "FlowOptions", "HostStore", "OffloadConfig", "OffloadConfigError",
    "OffloadError", "OffloadPlan", "OffloadStats", "OffloadWarning", "SegmentCost", "SegmentProfile",
    "SelectOptions", "Slot", "SpillDir", "StepProfile", "Store", "StoreOptions", "Streams", "TensorCache", "TensorProfile",
    "TieredStore", "attention_saved_contexts", "auto_blocks", "checkpoint_plan", "clean_stale", "clean_stale_ranks", "compile_blocks", "is_cheap", "offload", "offload_rank", "parse_memory_budget",
    "patch_schedules", "plan_budget", "plan_offload", "rank_path", "reclaim_stale", "recompute_plan", "restore_patches",
    "set_cheap_recompute", "set_recompute", "uncompile_blocks",
]

__getattr__ = forward(__name__)  # workload modelling moved to datapath.analysis: old names for one more release
