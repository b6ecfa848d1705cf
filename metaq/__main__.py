import sys

from metaq._cli import main

sys.exit(main())
