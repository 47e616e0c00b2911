"""The quantized matvec custom calls: which operands they take, and the jax-facing function.

`quantized_matvec(x, codes, scale, offset, bits)` computes `x @ W^T` for x
`[B, I]` float32 (B <= MAX_ROWS) and W `[O, I]` stored in groups of 32 inputs
with a float16 scale per group: one-byte codes (bits=8; uint8 with a float16
min per group, `W = code * scale + min`, or symmetric int8, GGUF Q8_0) or
nibbles (bits=4, GGUF's Q4 order; Q4_1 with a min, Q4_0 as `scale * (code -
8)`). It
is only valid where `available()` (kernels_cpu/library.py) is True; callers
check that when tracing and otherwise use the XLA path.

`activation_bits=8` or `16` (nibbles or Q8_0, an even number of groups,
`vnni()`): the activations are rounded per group of 32 to that many bits and
multiplied with VNNI integer dot products. 8 is llama.cpp's Q4 x Q8 / Q8_0 x
Q8 scheme (the activations' 8-bit rounding shows in the result, ~0.5% of its
range); 16 keeps 2^-16 of each group's largest activation, at one more dot
instruction per 64 weights, and is still ~1.5x fewer instructions than the
float tiles (kernels_cpu/quant_dot.h). 32: float32 activations.

Any row count up to MAX_ROWS runs blocked (kernels_cpu/quant_gemm.h: rows x
columns in cache-sized blocks over the threads), a prefill chunk as well as a
decode batch, and each output is computed by the same operations whatever the
other rows of the call: a row's result is bitwise the same alone or among
thousands (batch invariance), at every `activation_bits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_cpu.library import available, library_path, vnni

MAX_ROWS = 8192  # activation rows one call takes (matvec.cc's kMaxCallRows)
GROUP = 32
# (code bits, has a min) -> FFI target
_TARGETS = {(8, True): "xlaserve_int8_matvec_u8", (8, False): "xlaserve_int8_matvec_s8",
            (4, True): "xlaserve_q4_1_matvec", (4, False): "xlaserve_q4_0_matvec",
            (4, True, 8): "xlaserve_q4_1_matvec_q8", (4, False, 8): "xlaserve_q4_0_matvec_q8",
            (8, False, 8): "xlaserve_int8_matvec_s8_q8",
            (4, True, 16): "xlaserve_q4_1_matvec_q16", (4, False, 16): "xlaserve_q4_0_matvec_q16",
            (8, False, 16): "xlaserve_int8_matvec_s8_q16"}
ACTIVATION_BITS = (32, 16, 8)

__all__ = ["ACTIVATION_BITS", "MAX_ROWS", "available", "int8_matvec", "library_path",
           "quantized_matvec", "supports", "supports_integer_activations", "vnni"]


def supports(rows: int, codes: jax.Array, scale: jax.Array, offset: jax.Array | None,
             bits: int = 8) -> bool:
  """Whether `quantized_matvec` takes these operands (static shapes and dtypes)."""
  if not (1 <= rows <= MAX_ROWS and codes.ndim == 2 and scale.ndim == 2 and bits in (4, 8)):
    return False
  out_dim, in_dim = codes.shape[0], codes.shape[1] * 8 // bits
  if in_dim % GROUP or scale.shape != (out_dim, in_dim // GROUP) or scale.dtype != jnp.float16:
    return False
  if offset is not None and (offset.shape != scale.shape or offset.dtype != jnp.float16):
    return False
  if bits == 4:
    return codes.dtype == jnp.uint8
  if codes.dtype == jnp.uint8:
    return offset is not None
  return codes.dtype == jnp.int8 and offset is None


def supports_integer_activations(rows: int, codes: jax.Array, scale: jax.Array,
                                 offset: jax.Array | None, bits: int = 8) -> bool:
  """Whether `quantized_matvec(..., activation_bits=8 or 16)` takes these operands (and
  the CPU has VNNI): nibbles, or signed one-byte codes (Q8_0), in an even number of
  groups."""
  signed_bytes = bits == 8 and offset is None
  return ((bits == 4 or signed_bytes) and supports(rows, codes, scale, offset, bits)
          and scale.shape[1] % 2 == 0 and vnni())


def quantized_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array,
                     offset: jax.Array | None = None, bits: int = 8,
                     activation_bits: int = 32) -> jax.Array:
  """x [B, I] float32 -> [B, O] float32 (see module doc); needs `available()` and
  `supports(...)` (`supports_integer_activations` with activation_bits 8 or 16). bits=4:
  nibble codes [O, I/2] (GGUF Q4_1 with `offset`, else Q4_0)."""
  if activation_bits not in ACTIVATION_BITS:
    raise ValueError(f"activation_bits={activation_bits} not in {ACTIVATION_BITS}")
  rows, out_dim = x.shape[0], codes.shape[0]
  key = (bits, offset is not None)
  if activation_bits != 32:
    key += (activation_bits,)
  call = jax.ffi.ffi_call(_TARGETS[key], jax.ShapeDtypeStruct((rows, out_dim), jnp.float32))
  return call(x.astype(jnp.float32), codes, scale, scale if offset is None else offset)


def int8_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array,
                offset: jax.Array | None = None) -> jax.Array:
  """`quantized_matvec` of one-byte codes (uint8 with mins, or int8 / Q8_0)."""
  return quantized_matvec(x, codes, scale, offset, bits=8)
