"""Loads the native kernels' library and registers its XLA FFI targets.

`setup.py` compiles `matvec.cc`, `attention.cc` and `decoder.cc` into one shared library
(`_native*.so`) during `pip install`; it is loaded with ctypes on first use.
`available()` is False when the library was not built, does not load, or this
CPU lacks the instructions the kernels use (checked at run time by the
library itself), and callers then take the XLA path. `XLASERVE_NATIVE=0`
turns every native kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import jax

# FFI target name -> the handler symbol the library exports. A symbol is renamed when
# its operands change, so a library built from older sources fails `available()`
# (every caller takes the XLA path) instead of failing a call.
TARGETS = {
    "xlaserve_int8_matvec_u8": "XlaserveMatvecU8",
    "xlaserve_int8_matvec_s8": "XlaserveMatvecS8",
    "xlaserve_q4_1_matvec": "XlaserveMatvecQ4_1",
    "xlaserve_q4_0_matvec": "XlaserveMatvecQ4_0",
    "xlaserve_q4_1_matvec_q8": "XlaserveMatvecQ4_1Q8",
    "xlaserve_q4_0_matvec_q8": "XlaserveMatvecQ4_0Q8",
    "xlaserve_int8_matvec_s8_q8": "XlaserveMatvecS8Q8",
    "xlaserve_q4_1_matvec_q16": "XlaserveMatvecQ4_1Q16",
    "xlaserve_q4_0_matvec_q16": "XlaserveMatvecQ4_0Q16",
    "xlaserve_int8_matvec_s8_q16": "XlaserveMatvecS8Q16",
    "xlaserve_paged_attention": "XlaservePagedAttentionSinks",
    "xlaserve_decode_layers": "XlaserveDecodeLayersRows",  # up to 1024 rows
}


def library_path() -> str | None:
  """The compiled library next to this file (`_native*.so`), if the build made one."""
  found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_native*.so")))
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
    for name, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (OSError, AttributeError, ValueError):
    return False
  return True


@functools.cache
def vnni() -> bool:
  """True when `available()` and this CPU has AVX-512 VNNI (the integer-activation tiles)."""
  path = library_path()
  return available() and bool(ctypes.CDLL(path).xlaserve_native_vnni())
