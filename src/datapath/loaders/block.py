"""Deprecated module path: ``datapath.loaders.block`` moved to `datapath.sampling`; kept for one release (see `datapath._deprecated`)."""
from datapath._deprecated import forward

__getattr__ = forward(__name__)
