"""The number types of the command line's flags (argparse ``type=`` functions).

Each turns a flag's text into its value or raises
:class:`argparse.ArgumentTypeError` naming what was wrong, which argparse prints
with the flag's name (exit 2).  Shared by every sub-command.
"""

from __future__ import annotations

import argparse

__all__ = ["integer", "number", "non_negative_int", "positive_float", "port", "size",
           "duration"]


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on or connect to, 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return value


def size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = 1
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        return int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size (e.g. 1048576, 64K, 1G): {text!r}") \
            from None


def duration(text: str) -> float:
    """Seconds > 0, with an optional unit: ``500ms``, ``5s``, ``10m``, ``2h`` (bare: seconds)."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    mult = 1.0
    for unit in ("ms", "s", "m", "h"):
        if t.endswith(unit):
            mult, t = units[unit], t[:-len(unit)]
            break
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (e.g. 5s, 10m, 1h): {text!r}") \
            from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value
