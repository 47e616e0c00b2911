"""Native CPU kernels as XLA FFI custom calls, with the XLA path as the fallback.

`matvec.int8_matvec` multiplies a few activation rows by int8 group-quantized
weights, reading the one-byte codes once (XLA:CPU instead writes and re-reads
a float32 copy of the weight). The library is compiled by the package's own
build (setup.py) and loaded on first use; `matvec.available()` is False when
it was not built, cannot load, or this CPU lacks the instructions it uses
(checked at run time), and callers then use the XLA path. Like
kernels_pallas, this package imports nothing of ours. docs/performance.md,
"Native int8 matvec".
"""

from kernels_cpu.matvec import MAX_ROWS, available, int8_matvec

__all__ = ["MAX_ROWS", "available", "int8_matvec"]
