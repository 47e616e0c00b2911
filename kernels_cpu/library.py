"""Loads the native kernels' library, picks its instruction set and registers its FFI targets.

`setup.py` compiles `matvec.cc`, `attention.cc` and `decoder.cc` into one shared library
(`_native*.so`) during `pip install`; it is loaded with ctypes on first use. On x86-64
the library holds each kernel twice, for two instruction sets, each with its own handler
symbols; on aarch64 it holds one set:

- `avx512`: AVX-512 F/BW/VL + F16C + FMA (`xlaserve_native_isa()`); the
  integer-activation matvec tiles need AVX-512 VNNI as well (`vnni()`);
- `avx2`: AVX2 + FMA + F16C (`xlaserve_native_avx2()`); its integer-activation
  tiles use AVX2 int16 products (VPMADDWD, or AVX-VNNI where present), so they always run;
- `neon` (aarch64): Advanced SIMD (`xlaserve_native_neon()`); its integer-activation
  tiles use SDOT where the CPU has it and SMULL products otherwise, so they always run.

The AVX2 and NEON sets have no K-quant kernels: K-quant weights take the XLA path there
(`kquant_isa()`), and the fused decoder refuses them.

`isa()` is the set the kernels run with: by default the first of `ISAS` this CPU has
and the library exports; `XLASERVE_NATIVE_ISA=avx2` (or `avx512`) forces one (read
once per process), e.g. to test the AVX2 path on an AVX-512 machine. The FFI targets
of each usable set are registered under their own names (`target(name)` maps a
kernel's name to the chosen set's), so a jitted program calls the set it was traced
with. `available()` is False when the library was not built, does not load, lacks the
chosen set's symbols (built from older sources), or this CPU lacks its instructions;
callers then take the XLA path. `XLASERVE_NATIVE=0` turns every native kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import jax

ISAS = ("avx512", "avx2", "neon")  # in order of preference (a library has x86 or ARM sets)
# FFI target name -> the AVX-512 handler symbol the library exports. A symbol is renamed
# when its operands change, so a library built from older sources fails `available()`
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
    "xlaserve_q4_1_matvec_q8_tiled": "XlaserveMatvecQ4_1Q8Tiled",
    "xlaserve_q4_0_matvec_q8_tiled": "XlaserveMatvecQ4_0Q8Tiled",
    "xlaserve_int8_matvec_s8_q8_tiled": "XlaserveMatvecS8Q8Tiled",
    "xlaserve_q4_1_matvec_q16_tiled": "XlaserveMatvecQ4_1Q16Tiled",
    "xlaserve_q4_0_matvec_q16_tiled": "XlaserveMatvecQ4_0Q16Tiled",
    "xlaserve_int8_matvec_s8_q16_tiled": "XlaserveMatvecS8Q16Tiled",
    "xlaserve_q4_k_matvec": "XlaserveMatvecQ4K",
    "xlaserve_q5_k_matvec": "XlaserveMatvecQ5K",
    "xlaserve_q6_k_matvec": "XlaserveMatvecQ6K",
    "xlaserve_q4_k_matvec_q8": "XlaserveMatvecQ4KQ8",
    "xlaserve_q5_k_matvec_q8": "XlaserveMatvecQ5KQ8",
    "xlaserve_q6_k_matvec_q8": "XlaserveMatvecQ6KQ8",
    "xlaserve_q4_k_matvec_q16": "XlaserveMatvecQ4KQ16",
    "xlaserve_q5_k_matvec_q16": "XlaserveMatvecQ5KQ16",
    "xlaserve_q6_k_matvec_q16": "XlaserveMatvecQ6KQ16",
    "xlaserve_q4_k_matvec_q8_tiled": "XlaserveMatvecQ4KQ8Tiled",
    "xlaserve_q4_k_matvec_q16_tiled": "XlaserveMatvecQ4KQ16Tiled",
    "xlaserve_q6_k_matvec_q8_tiled": "XlaserveMatvecQ6KQ8Tiled",
    "xlaserve_q6_k_matvec_q16_tiled": "XlaserveMatvecQ6KQ16Tiled",
    "xlaserve_paged_attention": "XlaservePagedAttentionSinks",
    "xlaserve_decode_layers": "XlaserveDecodeLayersK",  # up to 1024 rows
}
# K-quant matvec targets: AVX-512 only (kquant_dot.h); on the AVX2 and NEON sets they take
# the XLA path (`kquant_isa()`), and their fused decoders refuse them.
KQUANT_TARGETS = frozenset(name for name in TARGETS if "_k_matvec" in name)
# Column-tiled weights (quant_format.h `IntWeight::tiled`): AVX-512 VNNI only (`tiles()`).
TILED_TARGETS = frozenset(name for name in TARGETS if name.endswith("_tiled"))
# The AVX2 and NEON handlers: the same kernels and operands, symbols with an `Avx2` /
# `Neon` suffix.
AVX2_TARGETS = {name: symbol + "Avx2" for name, symbol in TARGETS.items()
                if name not in KQUANT_TARGETS | TILED_TARGETS}
NEON_TARGETS = {name: symbol + "Neon" for name, symbol in TARGETS.items()
                if name not in KQUANT_TARGETS | TILED_TARGETS}
# isa -> (the library's CPU check, its targets). A library built for x86-64 exports the
# first two, one built for aarch64 the last.
SETS = {"avx512": ("xlaserve_native_isa", TARGETS),
        "avx2": ("xlaserve_native_avx2", AVX2_TARGETS),
        "neon": ("xlaserve_native_neon", NEON_TARGETS)}


def library_path() -> str | None:
  """The compiled library next to this file (`_native*.so`), if the build made one."""
  found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_native*.so")))
  return found[0] if found else None


def target(name: str, isa_name: str | None = None) -> str:
  """The FFI target of kernel `name` (a `TARGETS` key) for `isa_name` (default `isa()`)."""
  isa_name = isa_name or isa()
  return name if isa_name == "avx512" else f"{name}_{isa_name}"


def register(lib: ctypes.CDLL, sets: dict[str, tuple[str, dict[str, str]]]) -> frozenset[str]:
  """Registers the FFI targets of each of `sets` (isa -> (the library's CPU check, its
  targets)) whose check passes on this CPU and whose symbols `lib` all exports; -> those
  sets. A library built before a set's symbols (or a renamed one) leaves that set out."""
  usable = set()
  for isa_name, (check, targets) in sets.items():
    try:
      if not getattr(lib, check)():
        continue
      symbols = {name: getattr(lib, symbol) for name, symbol in targets.items()}
    except AttributeError:
      continue
    for name, symbol in symbols.items():
      jax.ffi.register_ffi_target(target(name, isa_name), jax.ffi.pycapsule(symbol),
                                  platform="cpu")
    usable.add(isa_name)
  return frozenset(usable)


@functools.cache
def usable_isas() -> frozenset[str]:
  """The instruction sets (`ISAS`) the library, loaded once, can run here; their targets
  registered."""
  path = library_path()
  if path is None:
    return frozenset()
  try:
    lib = ctypes.CDLL(path)
    # A library older than the blocked matvec (up to 32 rows a call) lacks this symbol.
    lib.xlaserve_matvec_max_rows.restype = ctypes.c_int64
    if lib.xlaserve_matvec_max_rows() < 1:
      return frozenset()
  except (OSError, AttributeError):
    return frozenset()
  return register(lib, SETS)


def matvec_max_rows() -> int:
  """The rows one matvec call takes, as the built library says (0 when not `available()`)."""
  if not available():
    return 0
  lib = ctypes.CDLL(library_path())
  lib.xlaserve_matvec_max_rows.restype = ctypes.c_int64
  return int(lib.xlaserve_matvec_max_rows())


@functools.cache
def isa() -> str | None:
  """The instruction set the native kernels run with (an `ISAS` name), or None (XLA path):
  `XLASERVE_NATIVE_ISA` if set (`auto`: the default), else the first usable one."""
  if os.environ.get("XLASERVE_NATIVE", "1") == "0":
    return None
  wanted = os.environ.get("XLASERVE_NATIVE_ISA", "auto")
  if wanted != "auto" and wanted not in ISAS:
    raise ValueError(f"XLASERVE_NATIVE_ISA={wanted!r} is not auto or one of {ISAS}")
  usable = usable_isas()
  if wanted != "auto":
    return wanted if wanted in usable else None
  return next((name for name in ISAS if name in usable), None)


def kquant_isa() -> bool:
  """True when the K-quant kernels run with the chosen set (AVX-512 only)."""
  return isa() == "avx512"


@functools.cache
def amx() -> bool:
  """True when the AVX-512 set's integer tiles use AMX for calls of 16 rows and more
  (the CPU has AMX-INT8 and `XLASERVE_NATIVE_AMX` is not 0; read once)."""
  path = library_path()
  return (isa() == "avx512" and path is not None
          and bool(ctypes.CDLL(path).xlaserve_native_amx()))


def tiles() -> bool:
  """True when the kernels read weights in the column-tiled layout (Q8_0 / Q4_0 / Q4_1 /
  Q4_K / Q6_K with integer activations; serving/models/quantized.py `tile_for_native`):
  the AVX-512 set on a CPU with VNNI (with AMX too: its tiles read the layout as well)."""
  return isa() == "avx512" and _cpu_vnni()


def available() -> bool:
  """True when the library is built, loads, registers, and this CPU can run it (`isa()`)."""
  return isa() is not None


@functools.cache
def _cpu_vnni() -> bool:
  path = library_path()
  return path is not None and bool(ctypes.CDLL(path).xlaserve_native_vnni())


def vnni() -> bool:
  """True when the integer-activation tiles run here: on the AVX-512 set where this CPU
  has AVX-512 VNNI, always on the AVX2 set (int16 products, quant_dot_avx2.h) and the
  NEON set (SDOT or SMULL products, quant_dot_neon.h)."""
  chosen = isa()
  return chosen in ("avx2", "neon") or (chosen == "avx512" and _cpu_vnni())
