"""Deprecated module path: ``datapath.loaders.graph`` moved to `datapath.graph`; kept for one release (see `datapath._deprecated`)."""
from datapath._deprecated import forward

__getattr__ = forward(__name__)
