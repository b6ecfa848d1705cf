"""Build hook for the optional C speedups; everything else is in setup.cfg.

``metaq.protocol._speedups`` is optional: without a C compiler (or Python headers) the
build step is skipped with a warning and metaq runs its pure-Python code paths
(see metaq/protocol/_fast.py).
"""

import sys

from setuptools import Extension, setup

_ARGS = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall"]

setup(ext_modules=[Extension("metaq.protocol._speedups", ["metaq/protocol/_speedups.c"],
                             optional=True,
                             extra_compile_args=_ARGS)])
