"""Deprecated module path: ``datapath.offload.ssd_plan`` moved to `datapath.analysis.ssd_plan`; kept for one release (see `datapath._deprecated`)."""
from datapath._deprecated import forward

__getattr__ = forward(__name__)
