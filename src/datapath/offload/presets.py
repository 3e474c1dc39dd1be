"""Deprecated alias of `datapath.analysis.presets` (moved there; this alias goes in the next release)."""
import sys
import warnings

from datapath.analysis import presets as _moved

warnings.warn("datapath.offload.presets moved to datapath.analysis.presets; import it from there "
              "(the old name goes in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
