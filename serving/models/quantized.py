"""Weight-only quantization: the `QuantizedWeight` leaf of the params pytree.

A `QuantizedWeight` stands in for a linear weight leaf of the params pytree
(docs/structure.md). Logically it is the `[..., In, Out]` matrix of `x @ w`;
it is stored output-channel-major, `[..., Out, In]` (the HF / GGUF row
layout), so groups run along the contraction axis and GGUF blocks map onto it
without a transpose. Kinds:

- `int8`: int8 codes `q [..., Out, In]`; `scale` per output channel
  `[..., Out]` (`group_size == 0`) or per group `[..., Out, In/g]` (GGUF Q8_0).
- `int4`: two codes a byte, `q` uint8 `[..., Out, In/2]`. Within each group of
  g inputs, byte j holds input j in its low nibble and input j + g/2 in its
  high nibble (GGUF's Q4_0 / Q4_1 order). Codes are unsigned 0..15:
  `w = scale * (code - 8)` without `offset` (Q4_0), `w = scale * code +
  offset` with one (Q4_1 "min"); `scale`, `offset` are `[..., Out, In/g]`.
- `fp8`: float8_e4m3fn codes `[..., Out, In]`, per-output-channel `scale`;
  emulated (converted to the compute dtype inside the matmul) on every backend.

`matmul(x)` dequantizes inside the jitted step, so XLA fuses the unpack and
scaling into one pass over the codes that feeds the dot: the full-precision
copy of a weight exists only as that one matmul's temporary, never for the
whole model. Per-channel kinds scale the dot's output instead of the weight.
On CPU the dequantized operand is float32 (XLA:CPU bf16 dots are slow, see
docs/performance.md); elsewhere it is the activation dtype.

A tied embedding is quantized as the LM head: `logical [D, V]`, stored
`[V, D]` — exactly the embedding table, so `lookup(ids)` returns embedding
rows (`serving.models.llama.embed_tokens`).

Weights become `QuantizedWeight`s on the host: rounded by
`checkpoints/quantizers.py`, kept as stored from GGUF blocks
(`checkpoints/quantize.py`), or fitted by GPTQ (`serving/tools/gptq.py`,
used by `xlaserve convert`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

KINDS = ("int8", "int4", "fp8")
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
DEFAULT_INT4_GROUP = 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
  """A quantized `[..., In, Out]` weight stored `[..., Out, In]` (see module doc)."""

  q: Any  # int8 [..., O, I] | uint8 [..., O, I/2] (int4) | float8_e4m3fn [..., O, I]
  scale: Any  # [..., O] (group_size 0) or [..., O, I/g]
  offset: Any = None  # int4 only: [..., O, I/g] additive min (GGUF Q4_1)
  kind: str = dataclasses.field(default="int8", metadata=dict(static=True))
  group_size: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: per channel

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind={self.kind!r} not in {KINDS}")
    if self.kind != "int4" and self.offset is not None:
      raise ValueError(f"an offset is only supported for int4, not {self.kind}")
    if self.kind == "int4" and (self.group_size <= 0 or self.group_size % 2):
      raise ValueError(f"int4 needs an even group_size > 0, got {self.group_size}")

  @property
  def in_features(self) -> int:
    return self.q.shape[-1] * (2 if self.kind == "int4" else 1)

  @property
  def out_features(self) -> int:
    return self.q.shape[-2]

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape `[..., In, Out]`."""
    return (*self.q.shape[:-2], self.in_features, self.out_features)

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in (self.q, self.scale, self.offset) if a is not None)

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

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The weight in storage orientation `[..., Out, In]`, as `dtype`."""
    return _dequantize_rows(self, self.q, self.scale, self.offset, dtype)

  def lookup(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Storage rows `[..., In]` for output channels `ids` (embedding lookup)."""
    off = None if self.offset is None else self.offset[ids]
    return _dequantize_rows(self, self.q[ids], self.scale[ids], off, dtype)

  def matmul(self, x: jax.Array) -> jax.Array:
    """x [..., In] -> x @ w [..., Out] in x.dtype, accumulating in float32."""
    cdt = _compute_dtype(x.dtype)
    w = self.after(x)
    if self.group_size == 0:  # per channel: dot the raw codes, scale the output
      out = jnp.einsum("...i,oi->...o", x.astype(cdt), w.q.astype(cdt),
                       preferred_element_type=jnp.float32)
      out = out * self.scale.astype(jnp.float32)
    else:
      out = jnp.einsum("...i,oi->...o", x.astype(cdt), w.dequantize(cdt),
                       preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def _compute_dtype(dtype):
  """float32 on CPU (XLA:CPU bf16 dots are slow), else the activation dtype."""
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.dtype(dtype)


def _dequantize_rows(w: QuantizedWeight, q, scale, offset, dtype) -> jax.Array:
  """Codes [..., R, C] (C packed for int4) and their scales -> [..., R, In] of dtype."""
  if w.group_size == 0:
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)
  g = w.group_size
  if w.kind == "int4":
    # [..., R, I/2] -> [..., R, G, g/2] -> nibbles -> [..., R, G, g]
    p = q.reshape(*q.shape[:-1], -1, g // 2)
    codes = jnp.concatenate([p & 0x0F, p >> 4], axis=-1).astype(jnp.float32)
    if offset is None:
      codes = codes - 8.0
  else:
    # [..., R, I] -> [..., R, G, g]
    codes = q.reshape(*q.shape[:-1], -1, g).astype(jnp.float32)
  vals = codes * scale.astype(jnp.float32)[..., None]
  if offset is not None:
    vals = vals + offset.astype(jnp.float32)[..., None]
  # [..., R, G, g] -> [..., R, I]
  return vals.reshape(*vals.shape[:-2], -1).astype(dtype)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedWeight)


def has_quantized(params: Any) -> bool:
  return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def params_nbytes(params: Any) -> int:
  """Bytes of every array in a params tree (quantized codes, scales and offsets)."""
  return sum(int(a.nbytes) for a in jax.tree.leaves(params))
