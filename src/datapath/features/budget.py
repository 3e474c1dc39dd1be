"""Memory budgets written the way people write them: ``"25%"``, ``"16GB"``, ``"10GiB"``, ``0.25``, ``2**30``."""
from __future__ import annotations

from datapath._runtime.sizes import SizeError, parse_size
from datapath.features.errors import FeatureStoreError


def parse_budget(value: str | float | int | None, total_bytes: int, what: str) -> int | None:
    """Bytes meant by ``value`` for a table of ``total_bytes``; None stays None.

    One meaning everywhere (`datapath._runtime.sizes`): ``"25%"`` and ``0.25`` / ``"0.25"`` are that
    share of the table, ``"16GB"``/``"10GiB"`` sizes, an int that many bytes.  ``what`` names the
    argument in errors (e.g. ``"gpu_cache"``, ``"--host-memory"``).

    Raises:
        FeatureStoreError: the value does not parse, is negative, or is a percentage above 100.
    """
    if value is None:
        return None
    try:
        return parse_size(value, total_bytes, what)
    except SizeError as exc:
        raise FeatureStoreError(str(exc)) from None


def format_bytes(n: int) -> str:
    """``n`` bytes as a short human string (GiB/MiB/KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
