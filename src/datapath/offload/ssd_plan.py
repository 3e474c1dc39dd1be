"""Deprecated alias of `datapath.analysis.ssd_plan` (moved there; this alias goes in the next release)."""
import sys
import warnings

from datapath.analysis import ssd_plan as _moved

warnings.warn("datapath.offload.ssd_plan moved to datapath.analysis.ssd_plan; import it from there "
              "(the old name goes in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
