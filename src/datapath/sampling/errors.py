"""Exceptions raised by `datapath.sampling`."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class SamplingError(DatapathError, ValueError):
    """A sampler was configured wrongly (fanouts, seeds) or asked to sample from memory it cannot read."""
