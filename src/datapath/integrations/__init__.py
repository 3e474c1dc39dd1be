"""Activation offloading inside trainers that run the loop themselves.

- `HFOffloadCallback`: a Hugging Face `transformers.Trainer` callback (needs ``datapath[hf]``);
- `LightningOffloadCallback`: a Lightning `Callback` (needs ``datapath[lightning]``);
- `OffloadSession`: what both are built on (one cache across steps; hooks on per step),
  for any other trainer with step-begin and step-end events.

Each keeps one offload cache for the whole run, so ``memory_budget=`` plans every step
from the steps before.  With `accelerate` (your own loop) no callback is needed:
``with offload(accelerator.unwrap_model(model), memory_budget="10GB"):`` around the loop.
Megatron-core's and DeepSpeed's pipeline schedules get their hints from
`datapath.offload.patch_schedules` (applied by ``offload()`` itself).
"""
from __future__ import annotations

import importlib
from typing import Any

from datapath.integrations.session import OffloadSession

__all__ = ["LightningOffloadCallback", "HFOffloadCallback", "OffloadSession"]

_LAZY = {"HFOffloadCallback": "datapath.integrations.hf", "LightningOffloadCallback": "datapath.integrations.lightning"}


def __getattr__(name: str) -> Any:
    """The callbacks import their trainer's package only when asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'datapath.integrations' has no attribute {name!r}")
