"""Weight-only quantization: the `QuantizedWeight` leaf of the params pytree.

A `QuantizedWeight` stands in for a linear weight leaf of the params pytree
(docs/structure.md). Logically it is the `[..., In, Out]` matrix of `x @ w`;
it is stored output-channel-major, `[..., Out, In]` (the HF / GGUF row
layout), so groups run along the contraction axis and GGUF blocks map onto it
without a transpose. Kinds:

- `int8`: int8 codes `q [..., Out, In]`; `scale` per output channel
  `[..., Out]` (`group_size == 0`) or per group `[..., Out, In/g]` (GGUF
  Q8_0); or, with a per-group `offset` (our default quantizer), uint8 codes
  on 256 levels from the group's min.
- `int4`: two codes a byte, `q` uint8 `[..., Out, In/2]`. Within each group of
  g inputs, byte j holds input j in its low nibble and input j + g/2 in its
  high nibble (GGUF's Q4_0 / Q4_1 order). Codes are unsigned 0..15.
- `int5`, `int6` (GGUF Q5_0/Q5_1/Q5_K, Q6_K): the low nibbles as for int4,
  plus `q_high` `[..., Out, In*b/8]` with the b = 1 or 2 bits above them:
  byte k holds inputs k*8/b onward, b bits each, from the lowest bits up.
- `fp8`: float8_e4m3fn codes `[..., Out, In]`, per-output-channel `scale` or
  per group; emulated (converted to the compute dtype inside the matmul).
- `mxfp4` (OCP microscaling, GPT-OSS experts): FP4 E2M1 codes two a byte, `q`
  uint8 `[..., Out, In/2]`, byte j holding input 2j in its low nibble and input
  2j + 1 in its high nibble (the checkpoint's `*_blocks` order); `scale` uint8
  E8M0 exponents `[..., Out, In/32]` (the checkpoint's `*_scales`): value
  `FP4[code] * 2^(scale - 127)`, FP4 = ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 3 the
  sign). Exact in any float dtype that holds the scale's power of two.

Values, per group of g inputs (`scale`, `offset`, `zero` are `[..., Out, In/g]`):
`scale * (code - zero)` with a zero point (GPTQ, AWQ), `scale * code +
offset` with an additive min (Q4_1, Q5_1, Q4_K, Q5_K, ours), else `scale *
(code - 2^(bits-1))` (Q4_0, Q5_0, Q6_K; int8 and fp8 codes are signed).
K-quants keep their two-level scales: `scale` and `offset` are then the
6- or 8-bit sub-block codes and each super-block of `super_size` inputs has
float16 `super_scale` / `super_offset` they multiply (`offset` = -dmin * m
is stored as `super_offset` = -dmin). GPTQ's act-order stores the inputs
sorted by group; `perm` [..., In] says which input each stored column is, and
`matmul` gathers the activations in that order.

`matmul(x)` dequantizes inside the jitted step, so XLA fuses the unpack and
scaling into one pass over the codes that feeds the dot: the full-precision
copy of a weight exists only as that one matmul's temporary, never for the
whole model. Per-channel kinds scale the dot's output instead of the weight.
On CPU the dequantized operand is float32 (XLA:CPU bf16 dots are slow, see
docs/performance.md); elsewhere it is the activation dtype.

With `quantized_dense_copy` (EngineConfig) a weight the native kernel reads
also carries `full`, its dequantized copy in the weight dtype: decode batches
of up to `NATIVE_ROWS_BESIDE_FULL` rows read the codes (the kernel is bound
by their conversion, not by bytes, and beats XLA's dot there), prefill and
larger batches take XLA's GEMM on the copy. Memory for speed at both ends.

On one device where the native kernels run on AVX-512 VNNI, the weights the integer
tiles read (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K with integer activations) are re-laid once at
load in the kernels' column-tiled layout (`tile_for_native`, `layout="tiles"`): the
same arrays and shapes, each block of 16 output channels' codes and per-channel arrays
(`TILED_VALUES`) in the order the tiles read them, one sequential stream a block
instead of sixteen (kernels_cpu/quant_format.h `IntWeight::tiled`). The native kernels read them
bitwise as they read the stored rows; every other reader (`dequantize`, the XLA
path) takes `rows_layout()` first.

A tied embedding is quantized as the LM head: `logical [D, V]`, stored
`[V, D]` — exactly the embedding table, so `lookup(ids)` returns embedding
rows (`serving.models.layers.embed_tokens`).

Weights become `QuantizedWeight`s on the host: rounded by
`checkpoints/quantizers.py`, kept as stored from GGUF blocks
(`checkpoints/quantize.py`) or HF GPTQ / AWQ / FP8 checkpoints
(`checkpoints/hf_quantized.py`), or fitted by GPTQ (`serving/tools/gptq.py`,
used by `xlaserve convert`). On a mesh their arrays split with the weight
(`sharding/rules.py: weight_spec`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kernels_cpu
from serving.models.layers import dot_f32_accumulate

KINDS = ("int8", "int4", "int5", "int6", "fp8", "mxfp4")
LAYOUTS = ("rows", "tiles")  # QuantizedWeight.layout
METHODS = ("int8", "int4", "fp8", "gguf")  # values of `quantization=` (gguf: blocks as stored)
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
EXPERT_KEYS = ("we_gate", "we_up", "we_down")
DEFAULT_INT4_GROUP = 64
DEFAULT_INT8_GROUP = 32  # llama.cpp's Q8_0 block
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CODE_BITS = {"int4": 4, "int5": 5, "int6": 6, "mxfp4": 4}  # nibble-packed kinds
MXFP4_GROUP = 32  # inputs sharing one E8M0 scale
# FP4 E2M1 code -> value: bit 3 the sign, bits 0-2 the magnitude.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
HIGH_BITS = {"int5": 1, "int6": 2}  # bits above the low nibble, in `q_high`
ROW_FIELDS = ("q", "scale", "offset", "zero", "q_high", "super_scale", "super_offset")
# The per-output-channel value arrays the column-tiled layout re-lays beside `q`.
TILED_VALUES = ("scale", "offset", "super_scale", "super_offset", "q_high")
FIELDS = (*ROW_FIELDS, "perm", "full")
# With a `full` copy beside the codes, the native kernel takes batches up to this many
# rows (where it beats XLA's dot); larger ones multiply the copy.
NATIVE_ROWS_BESIDE_FULL = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
  """A quantized `[..., In, Out]` weight stored `[..., Out, In]` (see module doc)."""

  q: Any  # int8 [..., O, I] | uint8 [..., O, I/2] (int4/5/6 low nibbles) | float8 [..., O, I]
  scale: Any  # [..., O] (group_size 0) or [..., O, I/g]; integer codes with super_scale
  offset: Any = None  # [..., O, I/g] additive min (GGUF Q4_1, Q4_K/Q5_K with super_offset)
  zero: Any = None  # uint8 [..., O, I/g] zero-point codes: w = scale * (code - zero)
  q_high: Any = None  # uint8 [..., O, I/8] (int5) or [..., O, I/4] (int6): the top code bits
  super_scale: Any = None  # f16 [..., O, I/S]: scale = scale codes * super_scale (K-quants)
  super_offset: Any = None  # f16 [..., O, I/S]: offset = offset codes * super_offset
  perm: Any = None  # int32 [..., I]: input j of the stored codes is input perm[j] (act-order)
  # [..., O, I] the dequantized weight in a dense dtype, kept beside the codes
  # (`with_full_copies`): prefill and large batches multiply it, small ones the codes.
  full: Any = None
  kind: str = dataclasses.field(default="int8", metadata=dict(static=True))
  group_size: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: per channel
  super_size: int = dataclasses.field(default=0, metadata=dict(static=True))  # S, K-quants
  # Nibble and Q8_0 weights on CPU: the native kernel rounds the activations per group of
  # 32 to 8 or 16 bits and uses integer dot products (`with_activation_bits`); 32: float.
  activation_bits: int = dataclasses.field(default=32, metadata=dict(static=True))
  # "rows": the arrays as stored (module doc); "tiles": q and its `TILED_VALUES` in the
  # native kernels' column-tiled layout (`tile_for_native`).
  layout: str = dataclasses.field(default="rows", metadata=dict(static=True))

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind={self.kind!r} not in {KINDS}")
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout={self.layout!r} not in {LAYOUTS}")
    if self.layout == "tiles" and not _tileable_kind(self):
      raise ValueError("the column-tiled layout holds Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights "
                       "(integer activations) without a dense copy")
    packed = self.kind in CODE_BITS
    if packed and (self.group_size <= 0 or self.group_size % 2):
      raise ValueError(f"{self.kind} needs an even group_size > 0, got {self.group_size}")
    if (self.q_high is not None) != (self.kind in HIGH_BITS):
      raise ValueError(f"q_high is needed exactly for {tuple(HIGH_BITS)}, not {self.kind}")
    if self.offset is not None and self.zero is not None:
      raise ValueError("a weight has an additive offset or a zero point, not both")
    if self.group_size == 0 and any(getattr(self, f) is not None for f in
                                    ("offset", "zero", "super_scale", "super_offset")):
      raise ValueError("offsets, zero points and super-block scales need a group_size")
    if (self.super_scale is not None) != (self.super_size > 0):
      raise ValueError("super_scale and super_size go together")
    if self.super_offset is not None and (self.super_scale is None or self.offset is None):
      raise ValueError("super_offset needs super_scale and offset codes")
    if self.super_size and self.super_size % self.group_size:
      raise ValueError(f"group_size={self.group_size} must divide super_size={self.super_size}")
    if self.kind == "mxfp4" and (self.group_size != MXFP4_GROUP or self.offset is not None
                                 or self.zero is not None or self.super_size):
      raise ValueError(f"mxfp4 has E8M0 scales per group of {MXFP4_GROUP} inputs and no "
                       f"offset, zero point or super-blocks (got group_size={self.group_size})")

  @property
  def in_features(self) -> int:
    return self.q.shape[-1] * (2 if self.kind in CODE_BITS else 1)

  @property
  def out_features(self) -> int:
    return self.q.shape[-2]

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape `[..., In, Out]`."""
    return (*self.q.shape[:-2], self.in_features, self.out_features)

  @property
  def bits(self) -> int:
    """Bits of one code (8 for int8 and fp8)."""
    return CODE_BITS.get(self.kind, 8)

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in self.arrays().values())

  def arrays(self) -> dict[str, Any]:
    """The fields that hold arrays, by name."""
    return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

  def __getitem__(self, idx) -> QuantizedWeight:
    """Indexes the leading (layer) axes, e.g. `w[i]` of a stacked `[L, ...]` weight."""
    if isinstance(idx, tuple) and len(idx) > self.q.ndim - 2:
      raise IndexError("only the leading (stacked) axes of a QuantizedWeight can be indexed")
    return jax.tree.map(lambda a: a[idx], self)

  def after(self, x: jax.Array) -> QuantizedWeight:
    """The same weight with its codes data-dependent on `x` (adds 0 unless x[0] is NaN).

    Without it XLA:CPU hoists every weight's dequantization to the start of an
    unrolled step and materialises all of them at once.
    """
    first = x.reshape(-1)[0]
    dep = (first != first).astype(jnp.uint8)
    if self.kind == "fp8":  # add on the bytes: fp8 has no integer add
      q = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(self.q, jnp.uint8) + dep,
                                       self.q.dtype)
    else:
      q = self.q + dep.astype(self.q.dtype)
    return dataclasses.replace(self, q=q)

  def rows_layout(self) -> QuantizedWeight:
    """The same weight with its arrays as stored (`layout="rows"`; a no-op for such)."""
    if self.layout == "rows":
      return self
    q, *values = kernels_cpu.matvec.untile_columns(
        self.q, 4 if self.kind in CODE_BITS else 8, *(getattr(self, f) for f in TILED_VALUES))
    if kquant_format(self) == "q6_k":
      q = kernels_cpu.matvec.nibbles_by_32(q, inverse=True)
    fields = dict(zip(TILED_VALUES, values, strict=True))
    return dataclasses.replace(self, q=q, **fields, layout="rows")

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The weight in storage orientation `[..., Out, In]`, as `dtype` (inputs in stored
    order: with `perm`, column j is input perm[j])."""
    w = self.rows_layout()
    return _dequantize_rows(w, {f: getattr(w, f) for f in ROW_FIELDS}, dtype)

  def lookup(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Storage rows `[..., In]` for output channels `ids` (embedding lookup)."""
    if self.perm is not None:
      raise ValueError("an embedding cannot have permuted inputs")
    if self.layout == "tiles":  # each id's row from its block of 16, without untiling all
      rows = dict.fromkeys(ROW_FIELDS)
      rows.update(zip(("q", *TILED_VALUES), kernels_cpu.matvec.tiled_rows(
          self.q, 4 if self.kind in CODE_BITS else 8, ids,
          *(getattr(self, f) for f in TILED_VALUES)), strict=True))
      if kquant_format(self) == "q6_k":
        rows["q"] = kernels_cpu.matvec.nibbles_by_32(rows["q"], inverse=True)
      return _dequantize_rows(dataclasses.replace(self, layout="rows"), rows, dtype)
    rows = {f: None if getattr(self, f) is None else getattr(self, f)[ids] for f in ROW_FIELDS}
    return _dequantize_rows(self, rows, dtype)

  def dense(self, x: jax.Array) -> jax.Array:
    """The logical `[..., In, Out]` matrix in the compute dtype for activations `x`,
    dequantized after `x` is known (for grouped matmuls such as MoE experts)."""
    if self.perm is not None:
      raise ValueError("a weight with permuted inputs has no dense form; use matmul")
    return jnp.swapaxes(self.after(x).dequantize(_compute_dtype(x.dtype)), -1, -2)

  def matmul(self, x: jax.Array) -> jax.Array:
    """x [..., In] -> x @ w [..., Out] in x.dtype, accumulating in float32."""
    # Few rows of 32-input groups on CPU: the FFI kernel (kernels_cpu).
    if self.runs_native(math.prod(x.shape[:-1])):
      rows = x.reshape(-1, x.shape[-1])
      bits = self.native_activation_bits(rows.shape[0])
      fmt = kquant_format(self)
      if fmt is None:
        out = kernels_cpu.quantized_matvec(rows, self.q, self.scale, self.offset, self.bits,
                                           activation_bits=bits,
                                           tiled=self.layout == "tiles")
      else:
        out = kernels_cpu.matvec.kquant_matvec(rows, fmt, self.q, self.scale, self.offset,
                                               self.q_high, self.super_scale,
                                               self.super_offset, activation_bits=bits,
                                               tiled=self.layout == "tiles")
      return out.reshape(*x.shape[:-1], -1).astype(x.dtype)
    if self.full is not None:
      return dot_f32_accumulate("...i,oi->...o", x, self.full).astype(x.dtype)
    cdt = _compute_dtype(x.dtype)
    w = self.rows_layout().after(x)
    xs = x if self.perm is None else jnp.take(x, self.perm, axis=-1)
    if self.group_size == 0:  # per channel: dot the raw codes, scale the output
      out = jnp.einsum("...i,oi->...o", xs.astype(cdt), w.q.astype(cdt),
                       preferred_element_type=jnp.float32)
      out = out * self.scale.astype(jnp.float32)
    else:
      out = jnp.einsum("...i,oi->...o", xs.astype(cdt), w.dequantize(cdt),
                       preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


  def runs_native(self, rows: int) -> bool:
    """Whether `matmul` of `rows` activation rows runs the native kernel: CPU, a
    `native_format` (groups of 32 of int8 codes, ours with a min or Q8_0, or nibbles,
    Q4_1 / Q4_0; or a GGUF K-quant, Q4_K / Q5_K / Q6_K), one weight (not stacked), at
    most MAX_ROWS rows (NATIVE_ROWS_BESIDE_FULL beside a `full` copy), and not traced on
    a mesh (XLA cannot split a custom call: it would gather the weight)."""
    if not native_format(self) or jax.default_backend() != "cpu":
      return False
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and math.prod(mesh.shape.values()) > 1:
      return False
    if self.full is not None and rows > NATIVE_ROWS_BESIDE_FULL:
      return False
    fmt = kquant_format(self)
    if fmt is not None:
      takes = kernels_cpu.matvec.supports_kquant(rows, fmt, self.q, self.scale, self.offset,
                                                 self.q_high, self.super_scale,
                                                 self.super_offset)
      if self.layout == "tiles":  # integer activations on AVX-512 VNNI only
        takes = takes and kernels_cpu.matvec.tiles()
    elif self.layout == "tiles":
      takes = kernels_cpu.matvec.supports_tiles(rows, self.q, self.scale, self.offset,
                                                self.bits)
    else:
      takes = kernels_cpu.matvec.supports(rows, self.q, self.scale, self.offset, self.bits)
    return takes and kernels_cpu.available()

  def native_activation_bits(self, rows: int) -> int:
    """The activation precision the native kernel uses for this weight at `rows` rows:
    `activation_bits` where the integer tiles take these operands (nibbles, Q8_0 or a
    K-quant, an even group count, a VNNI CPU), else 32 (float tiles)."""
    if self.activation_bits == 32:
      return 32
    if self.layout == "tiles":  # runs_native only where the tiles take these operands
      return self.activation_bits
    fmt = kquant_format(self)
    if fmt is not None:
      takes = kernels_cpu.matvec.supports_kquant(rows, fmt, self.q, self.scale, self.offset,
                                                 self.q_high, self.super_scale,
                                                 self.super_offset) and kernels_cpu.matvec.vnni()
    else:
      takes = kernels_cpu.matvec.supports_integer_activations(rows, self.q, self.scale,
                                                              self.offset, self.bits)
    return self.activation_bits if takes else 32


def native_format(w: QuantizedWeight) -> bool:
  """Codes the native matvec reads: int8 codes or nibbles in groups of 32 without
  super-blocks, or a GGUF K-quant as stored (`kquant_format`); no zero point or
  permutation."""
  if kquant_format(w) is not None:
    return True
  return (w.kind in ("int8", "int4") and w.group_size == 32 and not w.super_size
          and w.zero is None and w.perm is None)


def kquant_format(w: QuantizedWeight) -> str | None:
  """The kernels' name ("q4_k", "q5_k" or "q6_k") of a GGUF K-quant weight as
  `checkpoints/quantize.py` keeps it (super-blocks of 256; Q4_K / Q5_K: 32-input groups
  with min codes, Q6_K: 16-input groups centred on 32), which the native kernels read as
  stored; else None."""
  if w.super_size != 256 or w.zero is not None or w.perm is not None:
    return None
  with_min = w.offset is not None and w.super_offset is not None
  if w.kind in ("int4", "int5") and w.group_size == 32 and with_min:
    return "q4_k" if w.kind == "int4" else "q5_k"
  if w.kind == "int6" and w.group_size == 16 and w.offset is None:
    return "q6_k"
  return None


def with_activation_bits(params: Any, bits: int) -> Any:
  """Params whose nibble (Q4_0 / Q4_1), Q8_0 and GGUF K-quant (Q4_K / Q5_K / Q6_K)
  weights in a `native_format` multiply activations rounded per group of 32 to `bits`
  (8 or 16; 32: float) in the native kernel's integer tiles: exact integer sums per
  group (Q6_K: per 16 inputs), the same at any row count (kernels_cpu/quant_int.h). 8 is
  llama.cpp's Q4 x Q8 / Q8_0 x Q8 scheme: a fraction of the instructions per weight, the
  activations' 8-bit rounding showing in the result (~0.5% of its range). 16 keeps 2^-16
  of each group's largest activation at one more dot instruction per 64 weights
  (kernels_cpu/quant_dot.h)."""
  if bits not in kernels_cpu.matvec.ACTIVATION_BITS:
    raise ValueError(f"activation bits {bits} not in {kernels_cpu.matvec.ACTIVATION_BITS}")

  def mark(w):
    if not is_quantized(w) or not native_format(w):
      return w
    signed_bytes = w.kind == "int8" and w.offset is None
    if kquant_format(w) is None and not (w.kind == "int4" or signed_bytes):
      return w
    return dataclasses.replace(w, activation_bits=bits)

  return jax.tree.map(mark, params, is_leaf=is_quantized)


def _tileable_kind(w: QuantizedWeight) -> bool:
  """The column-tiled layout's kinds (static fields only: also checked while JAX rebuilds
  a weight from non-array leaves): Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K in a `native_format`,
  integer activations, no dense copy."""
  signed_bytes = w.kind == "int8" and w.offset is None
  fmt = kquant_format(w)
  legacy = fmt is None and (w.kind == "int4" or signed_bytes)
  return (native_format(w) and (legacy or fmt in kernels_cpu.matvec.TILED_K_FORMATS)
          and w.activation_bits != 32 and w.full is None)


def _tileable(w: QuantizedWeight) -> bool:
  """Whether `w` (either layout) can be held in the column-tiled layout: `_tileable_kind`,
  output channels a multiple of 16 and an even group count."""
  groups = w.scale.shape[-1] if w.scale.ndim >= 2 else 0
  return (_tileable_kind(w) and groups % 2 == 0 and groups > 0
          and w.q.shape[-2] % kernels_cpu.matvec.TILE_COLS == 0)


# The params whose weights `tile_for_native` lays out: the layers' linear weights, the LM
# head and the embedding (a tied head; `lookup` gathers its rows from their blocks).
TILED_KEYS = (*LINEAR_KEYS, "lm_head", "embed")


def tile_for_native(params: Any) -> Any:
  """Params whose `TILED_KEYS` weights that the integer tiles read (`_tileable`: Q8_0,
  Q4_0, Q4_1, Q4_K, Q6_K with integer activations) are in the native kernels'
  column-tiled layout (`layout="tiles"`, kernels_cpu/matvec.py `tile_columns`), on the
  host; other weights are unchanged. For one device where `kernels_cpu.matvec.tiles()`
  (AVX-512 VNNI; serving/runner/weights.py decides; where AMX runs, its tiles take their
  B tiles from the same layout). Same results bitwise (the tiles' integer sums are exact,
  the epilogue the same); batch-1 decode reads each block of 16 output channels as one
  stream."""
  def tile(path, w):
    key = getattr(path[-1], "key", None) if path else None
    if not is_quantized(w) or key not in TILED_KEYS or w.layout != "rows" or not _tileable(w):
      return w
    q = kernels_cpu.matvec.nibbles_by_32(np.asarray(w.q)) if kquant_format(w) == "q6_k" else w.q
    q, *values = kernels_cpu.matvec.tile_columns(q, 4 if w.kind in CODE_BITS else 8,
                                                 *(getattr(w, f) for f in TILED_VALUES))
    fields = dict(zip(TILED_VALUES, values, strict=True))
    return dataclasses.replace(w, q=q, **fields, layout="tiles")

  return jax.tree_util.tree_map_with_path(tile, params, is_leaf=is_quantized)


def with_full_copies(params: Any, dtype) -> Any:
  """Params whose quantized weights in a `native_format` carry a dequantized `full` copy
  as `dtype` (on the host, before the weights go to the device): batch-1 decode reads the
  codes through the native kernel, prefill and large batches take XLA's dot of the copy.
  Costs the copy's memory; other weights are unchanged."""
  def add(w):
    if not is_quantized(w) or not native_format(w):
      return w
    return dataclasses.replace(w, full=_dequantized_on_host(w, dtype))

  return jax.tree.map(add, params, is_leaf=is_quantized)


def _dequantized_on_host(w: QuantizedWeight, dtype) -> np.ndarray:
  """`w.dequantize()` of a `native_format` weight in numpy, as `dtype` `[..., Out, In]`
  (no device dispatch or compile per shape: start-up)."""
  q = np.asarray(w.q)
  lead = q.shape[:-1]
  g = w.group_size
  if w.kind in CODE_BITS:  # byte j of a group: input j (low nibble) and j + g/2 (high)
    b = q.reshape(*lead, -1, g // 2)
    codes = np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(np.float32)
  else:
    codes = q.reshape(*lead, -1, g).astype(np.float32)
  if w.q_high is not None:  # the bits above the nibble, `bits` per input from the lowest
    bits = HIGH_BITS[w.kind]
    qh = np.asarray(w.q_high)
    high = (qh[..., None] >> np.arange(0, 8, bits, dtype=np.uint8)) & ((1 << bits) - 1)
    codes += 16.0 * high.reshape(codes.shape).astype(np.float32)
  scale = _host_per_group(w, w.scale, w.super_scale)[..., None]
  if w.kind in CODE_BITS and w.offset is None:
    codes -= float(1 << (w.bits - 1))
  codes *= scale  # in place: one float32 temporary per weight
  if w.offset is not None:
    codes += _host_per_group(w, w.offset, w.super_offset)[..., None]
  return codes.reshape(*lead, -1).astype(dtype)


def _host_per_group(w: QuantizedWeight, codes, supers) -> np.ndarray:
  """`_per_group` in numpy: group values `[..., R, G]` as float32."""
  vals = np.asarray(codes, np.float32)
  if supers is None:
    return vals
  per = w.super_size // w.group_size
  grouped = vals.reshape(*vals.shape[:-1], -1, per)
  return (grouped * np.asarray(supers, np.float32)[..., None]).reshape(vals.shape)


def _compute_dtype(dtype):
  """float32 on CPU (XLA:CPU bf16 dots are slow), else the activation dtype."""
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.dtype(dtype)


def unpack_codes(w: QuantizedWeight, q, q_high) -> jax.Array:
  """The codes of rows `[..., R, C]` as float32 `[..., R, In]` (unsigned for int4/5/6)."""
  if w.kind not in CODE_BITS:
    return q.astype(jnp.float32)
  # Low nibbles: [..., R, I/2] -> [..., R, G, g/2] -> [..., R, G, g] (GGUF's Q4 order)
  p = q.reshape(*q.shape[:-1], -1, w.group_size // 2)
  low = jnp.concatenate([p & 0x0F, p >> 4], axis=-1).reshape(*q.shape[:-1], -1)
  if q_high is None:
    return low.astype(jnp.float32)
  # High bits: byte k holds inputs k*n .. k*n + n-1, `b` bits each from the lowest.
  b = HIGH_BITS[w.kind]
  shifts = jnp.arange(0, 8, b, dtype=jnp.uint8)
  high = (q_high[..., None] >> shifts) & ((1 << b) - 1)
  high = high.reshape(*q_high.shape[:-1], -1)
  return (low | (high << 4)).astype(jnp.float32)


def dequantize_mxfp4(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """MXFP4 rows -> `[..., R, In]` of dtype. q uint8 `[..., R, In/2]` (byte j: input 2j
  low nibble, 2j + 1 high), scale uint8 E8M0 `[..., R, In/32]` (module doc)."""
  lut = jnp.asarray(FP4_VALUES, jnp.float32)
  # [..., R, In/2] -> [..., R, In/2, 2] -> [..., R, G, 32]: low nibble first
  codes = jnp.stack([q & 0x0F, q >> 4], axis=-1).reshape(*q.shape[:-1], -1, MXFP4_GROUP)
  vals = lut[codes.astype(jnp.int32)]
  # 2^(e - 127) exactly, as float32 bits (e = 255, NaN in E8M0, reads inf). Values below
  # float32's normal range (e = 0, or 0.5 * 2^-126) read 0: XLA flushes subnormals.
  exp = jax.lax.bitcast_convert_type(scale.astype(jnp.int32) << 23, jnp.float32)
  vals = vals * exp[..., None]
  # [..., R, G, 32] -> [..., R, In]
  return vals.reshape(*vals.shape[:-2], -1).astype(dtype)


def _per_group(w: QuantizedWeight, codes, supers) -> jax.Array:
  """Group values `[..., R, G]` as float32; integer codes times their super-block's value."""
  vals = codes.astype(jnp.float32)
  if supers is None:
    return vals
  per = w.super_size // w.group_size  # groups per super-block
  grouped = vals.reshape(*vals.shape[:-1], -1, per)  # [..., R, G/per, per]
  return (grouped * supers.astype(jnp.float32)[..., None]).reshape(vals.shape)


def _dequantize_rows(w: QuantizedWeight, rows: dict[str, Any], dtype) -> jax.Array:
  """Rows of every field (`ROW_FIELDS`) -> float `[..., R, In]` of dtype."""
  if w.kind == "mxfp4":
    return dequantize_mxfp4(rows["q"], rows["scale"], dtype)
  codes = unpack_codes(w, rows["q"], rows["q_high"])
  if w.group_size == 0:
    return (codes * rows["scale"].astype(jnp.float32)[..., None]).astype(dtype)
  g = w.group_size
  codes = codes.reshape(*codes.shape[:-1], -1, g)  # [..., R, G, g]
  scale = _per_group(w, rows["scale"], rows["super_scale"])[..., None]
  if rows["zero"] is not None:
    vals = (codes - rows["zero"].astype(jnp.float32)[..., None]) * scale
  elif rows["offset"] is not None:
    vals = codes * scale + _per_group(w, rows["offset"], rows["super_offset"])[..., None]
  elif w.kind in CODE_BITS:  # symmetric: codes centred on 2^(bits-1)
    vals = (codes - float(1 << (w.bits - 1))) * scale
  else:
    vals = codes * scale
  # [..., R, G, g] -> [..., R, In]
  return vals.reshape(*vals.shape[:-2], -1).astype(dtype)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedWeight)


def has_quantized(params: Any) -> bool:
  return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def weight_formats(params: Any, float_dtype: str) -> str:
  """The weight formats in force, for the start-up line, e.g. "int4 g32 + int8 g32;
  other weights float32"."""
  leaves = jax.tree.leaves(params, is_leaf=is_quantized)
  kinds = sorted({_format(w) for w in leaves if is_quantized(w)})
  floats = f"{float_dtype}" if not kinds else f"other weights {float_dtype}"
  copies = sorted({str(w.full.dtype) for w in leaves if is_quantized(w) and w.full is not None})
  if copies:
    floats += f"; {'/'.join(copies)} copies for prefill and large batches"
  return "; ".join([" + ".join(kinds), floats] if kinds else [floats])


def _format(w: QuantizedWeight) -> str:
  group = f"g{w.group_size}" if w.group_size else "per channel"
  extra = f"/{w.super_size} super-blocks" if w.super_size else ""
  zero = ", zero points" if w.zero is not None else ""
  return f"{w.kind} {group}{extra}{zero}"


def params_nbytes(params: Any) -> int:
  """Bytes of every array in a params tree (quantized codes, scales and offsets)."""
  return sum(int(a.nbytes) for a in jax.tree.leaves(params))
