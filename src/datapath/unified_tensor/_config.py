"""The unified tensor's configuration is the row fetch's: `datapath.memory.gather_config`."""
from __future__ import annotations

from datapath.memory.config import GATHER_MODES, GatherConfig, GatherMode, gather_config

UnifiedConfig = GatherConfig
config = gather_config

__all__ = ["GATHER_MODES", "GatherMode", "UnifiedConfig", "config"]
