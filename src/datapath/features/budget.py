"""Memory budgets written the way people write them: ``"25%"``, ``"16GB"``, ``"10GiB"``, ``0.25``, ``2**30``."""
from __future__ import annotations

import math
import re

from datapath.features.errors import FeatureStoreError

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_HOW = ("a percentage of the table ('25%'), a size ('16GB' = 16e9 bytes, '10GiB' = 10 * 2**30, '512MB'), "
        "a fraction (0.25) or an integer number of bytes")


def parse_budget(value: str | float | int | None, total_bytes: int, what: str) -> int | None:
    """Bytes meant by ``value`` for a table of ``total_bytes``; None stays None.

    ``what`` names the argument in errors (e.g. ``"gpu_cache"``, ``"--host-memory"``).

    Raises:
        FeatureStoreError: the value does not parse, is negative, or is a percentage above 100.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise FeatureStoreError(f"{what}={value!r} is not a budget; use {_HOW}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise FeatureStoreError(f"{what}={value!r}: a float budget is a fraction of the table in [0, 1]; "
                                    f"use {_HOW}")
        nbytes = int(value * total_bytes)
    elif isinstance(value, str):
        nbytes = _parse_text(value, total_bytes, what)
    else:
        raise FeatureStoreError(f"{what}={value!r} is not a budget; use {_HOW}")
    if nbytes < 0:
        raise FeatureStoreError(f"{what}={value!r} is negative; use {_HOW}")
    return nbytes


def _parse_text(text: str, total_bytes: int, what: str) -> int:
    s = text.strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise FeatureStoreError(f"{what}={text!r} does not parse; use {_HOW}") from None
        if not math.isfinite(pct) or not 0.0 <= pct <= 100.0:
            raise FeatureStoreError(f"{what}={text!r}: a percentage must lie in [0%, 100%]")
        return int(total_bytes * pct / 100.0)
    m = _SIZE.match(s)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise FeatureStoreError(f"{what}={text!r} does not parse; use {_HOW}")
    number = float(m.group(1))
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``n`` bytes as a short human string (GiB/MiB/KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
