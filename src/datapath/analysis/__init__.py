"""Workload modelling for activation offloading: what a model saves, what a drive sustains, where each
strategy lands.

- `sweep` (module `rok`): run a model under keep / recompute / offload strategies and micro-batch
  sizes; the recompute-offload-keep (ROK) curve, its frontier and the best point under a budget.
- `plan` (module `ssd_plan`): SSDTrain's model of activation bytes per step, the write bandwidth
  needed to hide offloading, and the projected lifespan of the drives.
- `presets`: GPT/BERT/T5 stacks (`TransformerConfig`, `build_workload`) the two use.

The ``datapath rok`` and ``datapath ssd-plan`` commands (module `cli`) drive them.
"""
from datapath.analysis.presets import PRESETS, TransformerConfig, TransformerLM, Workload, build_workload, get_preset
from datapath.analysis.rok import (
    DEFAULT_STRATEGIES, STRATEGIES, RokError, Strategy, format_rows, load_model_factory, measure_flops_per_step,
    sweep,
)
from datapath.analysis.rok_result import RokPoint, RokResult
from datapath.analysis.ssd_plan import (
    DRIVES, GPUS, PAPER_TABLE_5_4, Drive, GpuSpec, Parallelism, PlanError, SsdPlan, TransformerShape,
    activation_breakdown, activation_bytes_per_step, model_flops_per_step, paper_table_5_4, plan, sweep_plan,
)

__all__ = [
    "DEFAULT_STRATEGIES", "DRIVES", "GPUS", "PAPER_TABLE_5_4", "PRESETS", "STRATEGIES", "Drive", "GpuSpec",
    "Parallelism", "PlanError", "RokError", "RokPoint", "RokResult", "SsdPlan", "Strategy", "TransformerConfig",
    "TransformerLM", "TransformerShape", "Workload", "activation_breakdown", "activation_bytes_per_step",
    "build_workload", "format_rows", "get_preset", "load_model_factory", "measure_flops_per_step",
    "model_flops_per_step", "paper_table_5_4", "plan", "sweep", "sweep_plan",
]
