"""Native CPU kernels as XLA FFI custom calls, with the XLA path as the fallback.

- `matvec.quantized_matvec` multiplies a few activation rows by weights in
  groups of 32 (int8 codes, GGUF Q8_0, Q4_1, Q4_0; `matvec.kquant_matvec`:
  GGUF Q4_K, Q5_K, Q6_K as stored), reading the codes once
  (XLA:CPU instead writes and re-reads a float32 copy of the weight).
- `paged_attention.paged_attention` attends a few queries per row over the KV
  page pool in place (the XLA path gathers and transposes every key block).
- `decoder.decode_layers` runs a decode step's whole decoder stack (norms,
  projections, RoPE, the K/V write, attention, MLP) in one call.

The library is compiled by the package's own build (setup.py) and loaded on
first use (library.py); `available()` is False when it was not built, cannot
load, or this CPU lacks the instructions it uses (checked at run time), and
callers then use the XLA path. Like kernels_pallas, this package imports
nothing of ours. docs/performance.md, "Native CPU kernels".
"""

from kernels_cpu import decoder, matvec, paged_attention
from kernels_cpu.library import available
from kernels_cpu.matvec import MAX_ROWS, int8_matvec, quantized_matvec

__all__ = ["MAX_ROWS", "available", "decoder", "int8_matvec", "matvec", "paged_attention",
           "quantized_matvec"]
