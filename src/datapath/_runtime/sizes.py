"""Byte sizes written the way people write them, with one meaning everywhere.

=====================  ===========================================================
``1073741824``, ``2**30``  an integer: that many bytes
``"10GB"``, ``"512MB"``    decimal units (kB, MB, GB, TB: powers of 1000)
``"10GiB"``, ``"512M"``    binary units (KiB, MiB, GiB, TiB and bare K, M, G, T)
``"25%"``                  that share of the total the caller names (device memory, the table)
``0.25``, ``"0.25"``       a fraction in [0, 1]: the same share
=====================  ===========================================================

A fraction above 1 that is not a whole number (``1.5``) is an error, never 1 byte.
"""
from __future__ import annotations

import math
import re

from datapath._runtime.errors import DatapathError

HOW = ("a size ('10GB' = 10e9 bytes, '10GiB' = 10 * 2**30, '512MB'), a share of the total ('25%' or a fraction "
       "in [0, 1] such as 0.25) or a whole number of bytes")

UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_TEXT = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[a-z]*)")


class SizeError(DatapathError, ValueError):
    """A byte size does not parse, or lies outside what its argument accepts."""


def _share_or_bytes(number: float, shown: str) -> tuple[float | None, int]:
    """A plain number: a share when in [0, 1], else a whole number of bytes (negatives reach the caller's check)."""
    if 0.0 <= number <= 1.0:
        return number, 0
    if number.is_integer():
        return None, int(number)
    raise SizeError(f"{shown} is neither a share in [0, 1] nor a whole number of bytes; use {HOW}")


def parse_size(value: int | float | str, total: int | None, name: str, *, minimum: int = 0) -> int:
    """The bytes ``value`` means (see the module docstring); a share is of ``total`` bytes.

    ``name`` names the argument, flag or variable in errors; ``minimum`` is the fewest bytes accepted.
    ``total=None``: shares are not accepted (there is nothing to take a share of).

    Raises:
        SizeError: the value does not parse, is negative, a percentage above 100, a fraction above 1
            that is not a whole number of bytes, a share where there is no total, or below ``minimum``.
    """
    shown = f"{name}={value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SizeError(f"{shown} is not a size; use {HOW}")
    share: float | None = None
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise SizeError(f"{shown} is not a size; use {HOW}")
        share, nbytes = _share_or_bytes(value, shown)
    else:
        text = value.strip().lower().replace("_", "")
        m = _TEXT.fullmatch(text)
        if m is None or (m.group(2) != "%" and m.group(2) not in UNITS):
            raise SizeError(f"{shown} does not parse; use {HOW}")
        number, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            if not 0.0 <= number <= 100.0:
                raise SizeError(f"{shown}: a percentage must lie in [0%, 100%]")
            share = number / 100.0
        elif unit == "" and not m.group(1).isdigit():  # "0.8", "1e9"
            share, nbytes = _share_or_bytes(number, shown)
        else:
            if not math.isfinite(number * UNITS[unit]):
                raise SizeError(f"{shown} is not a size; use {HOW}")
            nbytes = int(number * UNITS[unit])
    if share is not None:
        if total is None:
            raise SizeError(f"{shown}: a share needs a total, and {name} has none; give a size such as '10GB'")
        nbytes = int(share * total)
    if nbytes < 0:
        raise SizeError(f"{shown} is negative; use {HOW}")
    if nbytes < minimum:
        raise SizeError(f"{shown} is {nbytes:,} bytes; {name} must be at least {minimum:,} bytes")
    return nbytes
