"""Deprecated alias of `datapath.analysis.rok` (moved there; this alias goes in the next release)."""
import sys
import warnings

from datapath.analysis import rok as _moved

warnings.warn("datapath.offload.rok moved to datapath.analysis.rok; import it from there "
              "(the old name goes in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
