"""Errors of the feature store."""
from __future__ import annotations

from datapath._runtime.errors import DatapathError


class FeatureStoreError(DatapathError, ValueError):
    """Bad input to a `FeatureStore`: a budget that does not parse, a table file that does not match its shape."""


class DiskReadError(DatapathError, OSError):
    """A read of the disk tier failed or came back short; ``filename`` and ``offset`` say where."""

    def __init__(self, message: str, filename: str, offset: int, errno: int | None = None) -> None:
        super().__init__(message)
        self.filename = filename
        self.offset = offset
        self.errno = errno

    def __str__(self) -> str:  # OSError's own formatting would hide the message
        return self.args[0]


class ShardExchangeError(DatapathError, RuntimeError):
    """The exchange of a sharded feature store failed: another rank's fetch failed, or a rank died or stopped
    answering.  The message names the rank."""
