"""Deprecated module path: ``datapath.offload.presets`` moved to `datapath.analysis.presets`; kept for one release (see `datapath._deprecated`)."""
from datapath._deprecated import forward

__getattr__ = forward(__name__)
