"""The int8 group matvec custom call: loading, registration, the jax-facing function.

`int8_matvec(x, codes, scale, offset)` computes `x @ W^T` for x `[B, I]` float32
(B <= MAX_ROWS) and W `[O, I]` stored as one-byte codes in groups of 32 with a
float16 scale per group and, for uint8 codes, a float16 min (`W = code *
scale + min`); int8 codes are symmetric (GGUF Q8_0: `W = code * scale`). It
is only valid where `available()` is True; callers check that when tracing
and otherwise use the XLA path. Set `XLASERVE_NATIVE=0` to turn it off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import jax
import jax.numpy as jnp

MAX_ROWS = 8  # activation rows the kernel takes (its register accumulators)
GROUP = 32
_TARGETS = {"uint8": "xlaserve_int8_matvec_u8", "int8": "xlaserve_int8_matvec_s8"}
_SYMBOLS = {"uint8": "XlaserveMatvecU8", "int8": "XlaserveMatvecS8"}


def library_path() -> str | None:
  """The compiled library next to this file (`_matvec*.so`), if the build made one."""
  found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_matvec*.so")))
  return found[0] if found else None


@functools.cache
def available() -> bool:
  """True when the library is built, loads, registers, and this CPU can run it."""
  if os.environ.get("XLASERVE_NATIVE", "1") == "0":
    return False
  path = library_path()
  if path is None:
    return False
  try:
    lib = ctypes.CDLL(path)
    if not lib.xlaserve_native_isa():
      return False
    for codes, name in _TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, _SYMBOLS[codes])),
                                  platform="cpu")
  except (OSError, AttributeError, ValueError):
    return False
  return True


def supports(rows: int, codes: jax.Array, scale: jax.Array, offset: jax.Array | None) -> bool:
  """Whether `int8_matvec` takes these operands (static shapes and dtypes)."""
  if not (1 <= rows <= MAX_ROWS and codes.ndim == 2 and scale.ndim == 2):
    return False
  out_dim, in_dim = codes.shape
  if in_dim % GROUP or scale.shape != (out_dim, in_dim // GROUP) or scale.dtype != jnp.float16:
    return False
  if codes.dtype == jnp.uint8:
    return offset is not None and offset.shape == scale.shape and offset.dtype == jnp.float16
  return codes.dtype == jnp.int8 and offset is None


def int8_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array,
                offset: jax.Array | None = None) -> jax.Array:
  """x [B, I] float32 -> [B, O] float32 (see module doc); needs `available()`."""
  rows, out_dim = x.shape[0], codes.shape[0]
  kind = "uint8" if codes.dtype == jnp.uint8 else "int8"
  call = jax.ffi.ffi_call(_TARGETS[kind], jax.ShapeDtypeStruct((rows, out_dim), jnp.float32))
  return call(x.astype(jnp.float32), codes, scale, scale if offset is None else offset)
