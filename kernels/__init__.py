"""Kernels and their dispatch. Importing the package probes the CPU once and, where
`DIPTYCH_CPU_ISA` forces a lower ISA level, restricts the libraries torch calls
before any of them runs (see `kernels.cpu_isa`)."""

from kernels.cpu_isa import restrict_libraries as _restrict_libraries

_restrict_libraries()
