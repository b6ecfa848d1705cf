"""The per-message work, C or Python, chosen once: the only place that knows.

Each function below is bound at import to its C implementation (the optional
extension ``_speedups``) when that is built and switched on, else to its pure-Python
twin written next to it; callers import the name from :mod:`metaq.protocol` and
never ask which one they got.  :data:`SPEEDUPS_STATUS` says which, and why.

``metaq/protocol/_speedups.c`` does the consumer's per-message work (walk the headers,
verify CRC32s, build messages, call the listener) in C.  It is built by
``pip install`` when a C compiler and the Python headers are there; without
them the install goes on with a warning and every caller uses its pure-Python
code path, which gives the same results (``tests/test_speedups.py`` checks
both against each other).

``METAQ_NO_SPEEDUPS=1`` in the environment turns the C paths off, for
comparisons (``METAQ_NO_AVX512=1`` keeps the C code but folds CRC32s 128 bits at
a time, ``METAQ_NO_CLMUL=1`` uses its lookup tables).  ``metaq --version``
prints :data:`SPEEDUPS_STATUS`.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["speedups", "SPEEDUPS_STATUS", "EXPECTED_VERSION"]

#: The ``VERSION`` the Python side was written against; a stale build (an older
#: ``.so`` left next to newer sources) is ignored rather than misused.
EXPECTED_VERSION = 4


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("METAQ_NO_SPEEDUPS", "").strip() not in ("", "0"):
        return None, "off (METAQ_NO_SPEEDUPS is set)"
    try:
        _speedups = importlib.import_module("metaq.protocol._speedups")
    except ImportError as e:
        return None, f"not built ({e}); pure Python in use"
    if getattr(_speedups, "VERSION", None) != EXPECTED_VERSION:
        return None, (f"stale build (VERSION {getattr(_speedups, 'VERSION', None)}, "
                      f"want {EXPECTED_VERSION}): reinstall metaq-py")
    crc = ("AVX-512 carry-less multiply" if _speedups.VCLMUL else
           "carry-less multiply" if _speedups.CLMUL else "tables")
    return _speedups, f"in use (CRC32 by {crc})"


speedups, SPEEDUPS_STATUS = _load()


# ----------------------------------------------------------------------------------
# Reading side (consumer, Spark, tools): crc32, scan, take, deliver.
# ----------------------------------------------------------------------------------




# ----------------------------------------------------------------------------------
# Producer side: encode_puts.
# ----------------------------------------------------------------------------------




# ----------------------------------------------------------------------------------
# Broker side: fast_puts.
# ----------------------------------------------------------------------------------

import re  # noqa: E402  (the broker side's own imports, kept in its section)
from collections.abc import Mapping  # noqa: E402

from metaq.protocol._commands import INT32_MIN  # noqa: E402
from metaq.protocol._constants import INT32_MAX  # noqa: E402

__all__ += ["fast_puts", "fast_puts_python"]

# put <topic> <partition> <len> <flag> <checksum> <opaque>\r\n: the grammar of the C loop
# (``-?[0-9]{1,10}`` numbers, the sign only where Metaq allows one, a topic of 1..255
# bytes without space or line break); group 1 is the key ``b"<topic> <partition>"``.
_PUT_NUMBERS = rb" ([0-9]{1,10}) (-?[0-9]{1,10}) ([0-9]{1,10}) (-?[0-9]{1,10})\r\n"
_PUT = re.compile(rb"put ([^ \r\n]{1,255} -?[0-9]{1,10})" + _PUT_NUMBERS).match
_KEYED_PUTS: dict[bytes, object] = {}


def _keyed_put(key: bytes):  # type: ignore[no-untyped-def]
    """``_PUT`` for puts to one ``b"<topic> <partition>"`` (as matched by it): the same
    groups, found faster (a literal prefix instead of a scan of the topic)."""
    match = _KEYED_PUTS.get(key)
    if match is None:
        if len(_KEYED_PUTS) >= 1024:
            _KEYED_PUTS.clear()
        match = _KEYED_PUTS[key] = re.compile(
            b"put (" + re.escape(key) + b")" + _PUT_NUMBERS).match
    return match


def fast_puts_python(buf: bytes, pos: int, fast: Mapping[bytes, object], max_payload: int,
                     out: list) -> int:
    """The broker's put loop (``fast_puts`` of ``_speedups.c``), in Python.

    From ``pos``, every whole ``put <topic> <part> <len> <flag> <checksum> <opaque>\\r\\n
    <payload>`` whose ``b"<topic> <part>"`` maps to a target other than None in ``fast``
    becomes the tuple ``(target, length, flag, checksum, opaque_token, payload)``
    appended to ``out`` (the opaque as its decimal bytes, ready to echo); the loop
    stops at the first request that is anything else (a put cut short, over
    ``max_payload``, with a number out of the int32 range, with a transaction key, to
    an unknown partition, another command) and returns where, for the general parser
    to take it from there.  Numbers of at most 9 digits are in range without a check;
    after two puts in a row to one partition, a pattern for that partition is tried
    first (the general one again when it fails).
    """
    if not 0 <= pos <= len(buf):
        raise ValueError("fast_puts: pos outside the data")
    end = len(buf)
    get = fast.get
    append = out.append
    general = match = _PUT
    last_key = None
    while True:
        m = match(buf, pos)
        if m is None:
            if match is general:
                return pos
            match = general
            continue
        key, length, flag, check, opaque = m.groups()
        target = get(key)
        if target is None:
            return pos
        start = m.end()
        stop = start + int(length)
        if stop > end or stop - start > max_payload:
            return pos
        if flag == b"0":
            flag = 0
        else:
            flag = int(flag)
            if not INT32_MIN <= flag <= INT32_MAX:
                return pos
        check = int(check)
        if check > INT32_MAX or (len(opaque) > 9 and not INT32_MIN <= int(opaque) <= INT32_MAX):
            return pos
        append((target, stop - start, flag, check, opaque, buf[start:stop]))
        pos = stop
        if match is general:
            if key == last_key:
                match = _keyed_put(key)
            last_key = key


#: ``fast_puts(buf, pos, fast, max_payload, out) -> pos``: C when built (``fast`` must then
#: be a dict), else :func:`fast_puts_python`.
fast_puts = fast_puts_python if speedups is None else speedups.fast_puts
