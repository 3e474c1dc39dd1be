"""Deprecated module path: ``datapath.offload.rok`` moved to `datapath.analysis.rok`; kept for one release (see `datapath._deprecated`)."""
from datapath._deprecated import forward

__getattr__ = forward(__name__)
