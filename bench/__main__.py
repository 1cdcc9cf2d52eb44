"""`python -m bench ...` is `diptych bench ...`."""

import sys

from bench.cli import main

sys.exit(main())
