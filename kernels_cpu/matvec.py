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
multiplied with integer dot products (AVX-512 VNNI, AVX2 int16 products, or NEON SDOT). 8 is
llama.cpp's Q4 x Q8 / Q8_0 x Q8 scheme (the activations' 8-bit rounding shows in
the result, ~0.5% of its range); 16 keeps 2^-16 of each group's largest activation, at one more dot
instruction per 64 weights, and is still ~1.5x fewer instructions than the
float tiles (kernels_cpu/quant_dot.h). 32: float32 activations.

Any row count up to MAX_ROWS runs blocked (kernels_cpu/quant_gemm.h: rows x
columns in cache-sized blocks over the threads), a prefill chunk as well as a
decode batch, and each output is computed by the same operations whatever the
other rows of the call: a row's result is bitwise the same alone or among
thousands (batch invariance), at every `activation_bits`.
`kquant_matvec(x, fmt, q, scale, offset, q_high, super_scale, super_offset)`
does the same for GGUF K-quants kept as stored (`K_FORMATS`; I a multiple of
256): Q4_K / Q5_K nibbles in groups of 32 (Q5_K's fifth bits in `q_high`) with
uint8 6-bit scale and min codes per 32 and float16 d / -dmin per 256 inputs,
Q6_K nibbles in groups of 16 with two more bits each in `q_high`, int8 scales
per 16 and a float16 d per 256 (kernels_cpu/kquant_dot.h). Float32 or 8- / 16-bit
activations, as above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.library import available, kquant_isa, library_path, target, tiles, vnni

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
TILE_COLS = 16  # output columns a block of the column-tiled layout (`tile_columns`)
TILED_K_FORMATS = ("q4_k", "q6_k")  # the K-quants the column-tiled layout holds
SUPER = 256  # inputs per K-quant super-block
K_FORMATS = ("q4_k", "q5_k", "q6_k")
# K-quant format -> (scale codes per input, q_high bytes per input, scale dtype, has mins)
_K_LAYOUT = {"q4_k": (1 / 32, 0, jnp.uint8, True), "q5_k": (1 / 32, 1 / 8, jnp.uint8, True),
             "q6_k": (1 / 16, 1 / 4, jnp.int8, False)}

__all__ = ["ACTIVATION_BITS", "K_FORMATS", "MAX_ROWS", "TILED_K_FORMATS", "TILE_COLS",
           "available", "int8_matvec", "kquant_matvec", "library_path", "nibbles_by_32",
           "quantized_matvec", "supports", "supports_integer_activations", "supports_kquant",
           "supports_tiles", "tile_columns", "tiled_rows", "tiles", "untile_columns", "vnni"]


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


def _code_blocks(codes_shape: tuple[int, ...], bits: int) -> tuple[int, int]:
  """(groups of 32, 4-byte chunks a group) of [..., O, I*bits/8] codes."""
  width = codes_shape[-1]
  groups = width * 8 // bits // GROUP
  return groups, width // groups // 4


def tile_columns(codes, bits: int, *values):
  """Codes [..., O, I*bits/8] (nibbles: bits=4) and per-column value arrays [..., O, n]
  (scales, mins, a K-quant's scale codes and super-block values; None passes through) as
  stored -> the same shapes in the column-tiled layout the AVX-512 tiles read in one
  stream (kernels_cpu/quant_format.h `IntWeight::tiled`): each block of 16 output
  columns as codes [groups][chunks][16][4 bytes], values [n][16]. O a multiple of 16.
  Host arrays (numpy), once at load."""
  codes = np.asarray(codes)
  *lead, out_dim, _ = codes.shape
  if out_dim % TILE_COLS:
    raise ValueError(f"column tiles need O a multiple of {TILE_COLS}, got {out_dim}")
  groups, chunks = _code_blocks(codes.shape, bits)
  blocked = codes.reshape(*lead, out_dim // TILE_COLS, TILE_COLS, groups, chunks, 4)
  n = len(lead)  # [.., O/16, 16, groups, chunks, 4] -> [.., O/16, groups, chunks, 16, 4]
  tiled = np.ascontiguousarray(blocked.transpose(*range(n), n, n + 2, n + 3, n + 1, n + 4))
  def tile(v):
    if v is None:
      return None
    v = np.asarray(v)
    blocks = v.reshape(*v.shape[:-2], out_dim // TILE_COLS, TILE_COLS, v.shape[-1])
    return np.ascontiguousarray(np.swapaxes(blocks, -1, -2)).reshape(v.shape)
  return (tiled.reshape(codes.shape), *map(tile, values))


def untile_columns(codes, bits: int, *values):
  """The inverse of `tile_columns`, on jax or numpy arrays (inside a jitted step XLA
  fuses the transposes into whatever reads the codes)."""
  xp = np if isinstance(codes, np.ndarray) else jnp
  *lead, out_dim, _ = codes.shape
  groups, chunks = _code_blocks(codes.shape, bits)
  blocked = codes.reshape(*lead, out_dim // TILE_COLS, groups, chunks, TILE_COLS, 4)
  n = len(lead)  # [.., O/16, groups, chunks, 16, 4] -> [.., O/16, 16, groups, chunks, 4]
  rows = xp.transpose(blocked, (*range(n), n, n + 3, n + 1, n + 2, n + 4))
  def untile(v):
    if v is None:
      return None
    blocks = v.reshape(*v.shape[:-2], out_dim // TILE_COLS, v.shape[-1], TILE_COLS)
    return xp.swapaxes(blocks, -1, -2).reshape(v.shape)
  return (rows.reshape(codes.shape), *map(untile, values))


def nibbles_by_32(q, inverse: bool = False):
  """Nibbles [..., O, I/2] in groups of 16 (Q6_K's order: byte j of a group's 8 holds
  input j and j + 8) -> groups of 32 (byte j of 16: input j and j + 16), the order the
  column-tiled layout's chunks take (`inverse`: back). numpy or jax arrays."""
  xp = np if isinstance(q, np.ndarray) else jnp
  b = q.reshape(*q.shape[:-1], -1, 2, 8) if not inverse else q.reshape(*q.shape[:-1], -1, 16)
  lo, hi = b & 15, b >> 4
  if not inverse:  # inputs 0-7, 8-15 | 16-23, 24-31 of each group of 32
    inputs = xp.concatenate([lo[..., 0, :], hi[..., 0, :], lo[..., 1, :], hi[..., 1, :]], -1)
    out = inputs[..., :16] | (inputs[..., 16:] << 4)
  else:  # inputs j and j + 16 -> per 16: (j, j + 8)
    inputs = xp.concatenate([lo, hi], -1)
    halves = inputs.reshape(*inputs.shape[:-1], 2, 16)
    out = (halves[..., :8] | (halves[..., 8:] << 4)).reshape(*inputs.shape[:-1], 16)
  return out.astype(q.dtype).reshape(q.shape)


def tiled_rows(codes, bits: int, ids, *values):
  """Rows `ids` [...] of a 2-D weight in the column-tiled layout, as stored rows: codes
  [..., I*bits/8] and each value array's [..., n] (a gather of just those bytes: an
  embedding lookup)."""
  out_dim, width = codes.shape
  groups, chunks = _code_blocks(codes.shape, bits)
  block, col = ids // TILE_COLS, ids % TILE_COLS
  q = codes.reshape(out_dim // TILE_COLS, groups, chunks, TILE_COLS, 4)[block, :, :, col, :]
  def rows(v):
    return None if v is None else v.reshape(out_dim // TILE_COLS, v.shape[-1],
                                            TILE_COLS)[block, :, col]
  return (q.reshape(*ids.shape, width), *map(rows, values))


def supports_tiles(rows: int, codes: jax.Array, scale: jax.Array, offset: jax.Array | None,
                   bits: int = 8) -> bool:
  """Whether `quantized_matvec(..., tiled=True)` takes these operands: those of
  `supports_integer_activations`, O a multiple of 16, and `tiles()` (AVX-512 VNNI)."""
  return (supports_integer_activations(rows, codes, scale, offset, bits) and tiles()
          and codes.shape[0] % TILE_COLS == 0)


def quantized_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array,
                     offset: jax.Array | None = None, bits: int = 8,
                     activation_bits: int = 32, tiled: bool = False) -> jax.Array:
  """x [B, I] float32 -> [B, O] float32 (see module doc); needs `available()` and
  `supports(...)` (`supports_integer_activations` with activation_bits 8 or 16). bits=4:
  nibble codes [O, I/2] (GGUF Q4_1 with `offset`, else Q4_0). `tiled`: the operands in the
  column-tiled layout (`tile_columns`; integer activations, `supports_tiles`)."""
  if activation_bits not in ACTIVATION_BITS:
    raise ValueError(f"activation_bits={activation_bits} not in {ACTIVATION_BITS}")
  if tiled and activation_bits == 32:
    raise ValueError("column-tiled weights take integer activations (8 or 16 bits)")
  rows, out_dim = x.shape[0], codes.shape[0]
  key = (bits, offset is not None)
  if activation_bits != 32:
    key += (activation_bits,)
  name = _TARGETS[key] + ("_tiled" if tiled else "")
  call = jax.ffi.ffi_call(target(name),
                          jax.ShapeDtypeStruct((rows, out_dim), jnp.float32))
  return call(x.astype(jnp.float32), codes, scale, scale if offset is None else offset)


def int8_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array,
                offset: jax.Array | None = None) -> jax.Array:
  """`quantized_matvec` of one-byte codes (uint8 with mins, or int8 / Q8_0)."""
  return quantized_matvec(x, codes, scale, offset, bits=8)


def supports_kquant(rows: int, fmt: str, q: jax.Array, scale: jax.Array,
                    offset: jax.Array | None, q_high: jax.Array | None,
                    super_scale: jax.Array, super_offset: jax.Array | None) -> bool:
  """Whether `kquant_matvec` takes these K-quant operands (static shapes and dtypes; float
  activations, and integer ones where `vnni()`; the AVX-512 set only: `kquant_isa()`)."""
  if fmt not in K_FORMATS or not 1 <= rows <= MAX_ROWS or q.ndim != 2 or not kquant_isa():
    return False
  per_scale, per_high, scale_dtype, has_min = _K_LAYOUT[fmt]
  out_dim, in_dim = q.shape[0], q.shape[1] * 2
  if in_dim % SUPER or q.dtype != jnp.uint8:
    return False
  shaped = lambda a, cols, dtype: (  # noqa: E731
      a is not None and a.shape == (out_dim, int(cols)) and a.dtype == dtype)
  ok = (shaped(scale, in_dim * per_scale, scale_dtype)
        and shaped(super_scale, in_dim // SUPER, jnp.float16))
  if has_min:
    ok = ok and shaped(offset, in_dim // GROUP, jnp.uint8) and shaped(
        super_offset, in_dim // SUPER, jnp.float16)
  elif offset is not None or super_offset is not None:
    return False
  if per_high:
    ok = ok and shaped(q_high, in_dim * per_high, jnp.uint8)
  elif q_high is not None:
    return False
  return ok


def kquant_matvec(x: jax.Array, fmt: str, q: jax.Array, scale: jax.Array,
                  offset: jax.Array | None, q_high: jax.Array | None, super_scale: jax.Array,
                  super_offset: jax.Array | None, activation_bits: int = 32,
                  tiled: bool = False) -> jax.Array:
  """x [B, I] float32 -> [B, O] float32 for a K-quant weight (module doc); needs
  `available()` and `supports_kquant(...)`, and `vnni()` for activation_bits 8 or 16.
  `tiled`: a Q4_K / Q6_K weight in the column-tiled layout (`tile_columns` of q — Q6_K's
  re-paired by `nibbles_by_32` first — and its value arrays, Q6_K's q_high among them;
  integer activations, `tiles()`)."""
  if activation_bits not in ACTIVATION_BITS:
    raise ValueError(f"activation_bits={activation_bits} not in {ACTIVATION_BITS}")
  if tiled and (activation_bits == 32 or fmt not in TILED_K_FORMATS):
    raise ValueError("column-tiled K-quants are Q4_K / Q6_K with integer activations (8 or "
                     "16 bits)")
  target = f"xlaserve_{fmt}_matvec" + ("" if activation_bits == 32 else f"_q{activation_bits}")
  target += "_tiled" if tiled else ""
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32))
  # An operand the format lacks is any array (the kernel does not read it).
  return call(x.astype(jnp.float32), q, scale, scale if offset is None else offset,
              q if q_high is None else q_high, super_scale,
              super_scale if super_offset is None else super_offset)
