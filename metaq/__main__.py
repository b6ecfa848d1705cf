"""``python -m metaq``: the command line (see :mod:`metaq._cli`)."""

import sys

from metaq._cli import main

sys.exit(main())
