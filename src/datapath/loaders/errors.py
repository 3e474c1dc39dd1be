"""Exceptions raised by `datapath.loaders`."""
from __future__ import annotations

from datapath.sampling.errors import SamplingError


class LoaderError(SamplingError):
    """A loader was configured wrongly (batch size, seeds, tables that do not match the graph, placement),
    or a batch could not be made (a gather read an out-of-range node id)."""
