"""Every ``DATAPATH_*`` environment variable: read and checked here, and only here.

==================================  =====================================================================
``DATAPATH_GATHER_SYNC``            ``1`` | ``0``: wait for every GPU gather and raise at once
``DATAPATH_GATHER_MODE``            ``circular`` | ``shift_mask`` | ``unaligned``
``DATAPATH_GATHER_SORT``            ``auto`` | ``1`` | ``0``
``DATAPATH_GATHER_THREADS``         threads per block of the row kernels: a multiple of 32 in [32, 1024]
``DATAPATH_GATHER_BLOCKS_PER_SM``   blocks per multiprocessor of the kernels reading host memory (>= 1)
``DATAPATH_GATHER_LAUNCHER``        ``native`` | ``driver`` | ``cupy``
``DATAPATH_SHM_DIR``                the directory of shared tables (a tmpfs; default ``/dev/shm``)
``DATAPATH_UNIFIED_DEVICE``         ``1``: name PyTorch's PrivateUse1 device "unified" at import
``DATAPATH_OPS_PROBE``              ``0``: pick aggregation kernels by the cost model, without timing them
``DATAPATH_OPS_DEBUG``              ``1``: the aggregation kernels check their inputs' values from the start
``DATAPATH_CACHE_DIR``              where the native launcher is built (default ``~/.cache/datapath``)
``DATAPATH_SHARE_PREFIX``           the name prefix of one job's shared tables (letters, digits, ``-``, ``_``)
==================================  =====================================================================

A module that needs one calls `get` where it uses it: a bad value raises `SettingError`, one line
naming the variable, the value and what is accepted -- at that point, never at ``import datapath``
(a setting read while importing uses `at_import`: the bad value is logged once and the default kept).
`problems` lists every bad or unknown ``DATAPATH_*`` variable (``datapath info`` shows them).
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datapath._runtime.errors import DatapathError

PREFIX = "DATAPATH_"


class SettingError(DatapathError, ValueError):
    """A ``DATAPATH_*`` environment variable holds a value its setting does not accept."""


@dataclass(frozen=True)
class Setting:
    """One variable: its default, how its text becomes a value (raising ValueError), what it accepts."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    accepted: str


def _flag(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _sort(text: str) -> bool | str:
    return "auto" if text.strip().lower() == "auto" else _flag(text)


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in values:
            raise ValueError
        return v
    return parse


def _int(lo: int, hi: int | None = None, multiple: int = 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text.strip())
        if v < lo or (hi is not None and v > hi) or v % multiple:
            raise ValueError
        return v
    return parse


def _directory(text: str) -> Path:
    p = Path(text.strip()).expanduser()
    if not text.strip() or (p.exists() and not p.is_dir()):
        raise ValueError
    return p


def _optional_directory(text: str) -> Path | None:
    return _directory(text) if text.strip() else None


def _prefix(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text.strip()):
        raise ValueError
    return text.strip()


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("DATAPATH_GATHER_SYNC", None, _flag, "1 or 0"),
    Setting("DATAPATH_GATHER_MODE", None, _choice("circular", "shift_mask", "unaligned"),
            "circular, shift_mask or unaligned"),
    Setting("DATAPATH_GATHER_SORT", None, _sort, "auto, 1 or 0"),
    Setting("DATAPATH_GATHER_THREADS", None, _int(32, 1024, 32), "a multiple of 32 in [32, 1024]"),
    Setting("DATAPATH_GATHER_BLOCKS_PER_SM", None, _int(1), "an integer >= 1"),
    Setting("DATAPATH_GATHER_LAUNCHER", None, _choice("native", "driver", "cupy"), "native, driver or cupy"),
    Setting("DATAPATH_SHM_DIR", Path("/dev/shm"), _directory,
            "a directory (a tmpfs such as /dev/shm), not a file"),
    Setting("DATAPATH_UNIFIED_DEVICE", False, _flag, "1 or 0"),
    Setting("DATAPATH_OPS_PROBE", True, _flag, "1 or 0"),
    Setting("DATAPATH_OPS_DEBUG", False, _flag, "1 or 0"),
    Setting("DATAPATH_CACHE_DIR", None, _optional_directory, "a directory, not a file"),
    Setting("DATAPATH_SHARE_PREFIX", None, _prefix, "1 to 64 letters, digits, '-' or '_'"),
)}

GATHER = tuple(n for n in SETTINGS if n.startswith("DATAPATH_GATHER_"))


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` from ``env`` (default ``os.environ``); its default when unset.

    Raises:
        SettingError: the variable is set to a value the setting does not accept.
    """
    s = SETTINGS[name]
    text = (os.environ if env is None else env).get(name)
    if text is None:
        return s.default
    try:
        return s.parse(text)
    except ValueError:
        raise SettingError(f"environment variable {name}={text!r} is not accepted: it must be {s.accepted} "
                           f"(unset it for the default)") from None


def at_import(name: str) -> Any:
    """`get` for a setting read while a module is imported: a bad value is said once (one logged line naming the
    variable and what it accepts) and the default is used, so that ``import datapath`` never fails."""
    try:
        return get(name)
    except SettingError as exc:
        logging.getLogger("datapath").warning("%s; using the default, %r", exc, SETTINGS[name].default)
        return SETTINGS[name].default


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    return name in (os.environ if env is None else env)


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """One line per bad value, and per ``DATAPATH_*`` variable that no setting reads (a typo?)."""
    env = os.environ if env is None else env
    out = []
    for name in sorted(k for k in env if k.startswith(PREFIX)):
        if name not in SETTINGS:
            out.append(f"environment variable {name} is not a datapath setting (known: {', '.join(SETTINGS)})")
            continue
        try:
            get(name, env)
        except SettingError as exc:
            out.append(str(exc))
    return out


def current(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``DATAPATH_*`` settings set in ``env``, as written."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k in SETTINGS}
