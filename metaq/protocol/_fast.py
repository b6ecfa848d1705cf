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
