"""`python -m kernels [--env LEVEL]`: the CPU probe, or a forced level's environment."""

import sys

from kernels.cpu_isa import main

raise SystemExit(main(sys.argv[1:]))
