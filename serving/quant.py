"""Weight-only quantization: the `QuantizedWeight` pytree and host-side quantizers.

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
JAX_NOTES.md); elsewhere it is the activation dtype.

A tied embedding is quantized as the LM head: `logical [D, V]`, stored
`[V, D]` — exactly the embedding table, so `lookup(ids)` returns embedding
rows (`serving.models.llama.embed_tokens`).

The host quantizers here round (int4: min + scale fitted by least squares);
`quantize_params(..., calibration=...)` instead quantizes int4 layers by
GPTQ on calibration activations (`serving/quant_calibration.py`, used by
`xlaserve convert`), into the same format.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

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


# ---- host-side quantizers (numpy in, numpy-backed QuantizedWeight out) ----


def _rows(w: np.ndarray, transpose: bool) -> np.ndarray:
  """Float32 `[..., Out, In]` from a `[..., In, Out]` weight (or as is)."""
  w = np.asarray(w).astype(np.float32)
  return np.swapaxes(w, -1, -2) if transpose else w


def quantize_int8(w: np.ndarray, group_size: int = 0, *, transpose: bool = True
                  ) -> QuantizedWeight:
  """Symmetric int8 of a `[..., In, Out]` weight (`transpose=False`: already `[..., Out, In]`)."""
  r = _rows(w, transpose)
  if group_size:
    grouped = r.reshape(*r.shape[:-1], -1, group_size)  # [..., O, G, g]
    scale = (np.abs(grouped).max(-1) / 127.0).astype(np.float16)
    s = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    q = np.clip(np.rint(grouped / s), -127, 127).astype(np.int8).reshape(r.shape)
  else:
    scale = (np.abs(r).max(-1) / 127.0).astype(np.float32)
    s = np.where(scale == 0, 1, scale)[..., None]
    q = np.clip(np.rint(r / s), -127, 127).astype(np.int8)
  return QuantizedWeight(q=q, scale=scale, kind="int8", group_size=group_size)


def _fit_min_scale(grouped, refine: int, xp=np, weights=None):
  """Per-group (scale, min) as float16 for 16 levels: min/max, then `refine` rounds of
  least squares of the weights on their codes (lowers the squared error ~20%).

  `grouped` is `[..., G, g]`; `weights` (broadcastable to it, optional) weight each
  element's squared error (GPTQ passes its per-column costs); `xp` is numpy or
  jax.numpy (the GPTQ loop runs it traced).
  """
  lo, hi = grouped.min(-1, keepdims=True), grouped.max(-1, keepdims=True)
  scale, offset = (hi - lo) / 15.0, lo
  wts = xp.ones_like(grouped) if weights is None else xp.broadcast_to(weights, grouped.shape)
  mean = lambda a: (a * wts).sum(-1, keepdims=True) / wts.sum(-1, keepdims=True)
  for _ in range(refine):
    codes = xp.clip(xp.rint((grouped - offset) / xp.where(scale == 0, 1, scale)), 0, 15)
    c_mean, w_mean = mean(codes), mean(grouped)
    c_var = mean((codes - c_mean) ** 2)
    cov = mean((codes - c_mean) * (grouped - w_mean))
    fitted = xp.where(c_var > 0, cov / xp.where(c_var > 0, c_var, 1), scale)
    scale, offset = xp.maximum(fitted, 0), w_mean - xp.maximum(fitted, 0) * c_mean
  return scale[..., 0].astype(xp.float16), offset[..., 0].astype(xp.float16)


def quantize_int4(w: np.ndarray, group_size: int = DEFAULT_INT4_GROUP, *,
                  asymmetric: bool = True, refine: int = 2,
                  transpose: bool = True) -> QuantizedWeight:
  """Group-wise int4 (fitted min + scale, or symmetric absmax), packed two a byte."""
  r = _rows(w, transpose)
  if r.shape[-1] % group_size:
    raise ValueError(f"group_size={group_size} must divide the input dim {r.shape[-1]}")
  grouped = r.reshape(*r.shape[:-1], -1, group_size)  # [..., O, G, g]
  if asymmetric:
    scale, offset = _fit_min_scale(grouped, refine)
    s = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    codes = np.rint((grouped - offset.astype(np.float32)[..., None]) / s)
  else:
    scale = (np.abs(grouped).max(-1) / 7.0).astype(np.float16)
    offset = None
    s = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    codes = np.rint(grouped / s) + 8
  return QuantizedWeight(q=pack_int4(codes.reshape(r.shape), group_size), scale=scale,
                         offset=offset, kind="int4", group_size=group_size)


def pack_int4(codes: np.ndarray, group_size: int) -> np.ndarray:
  """Codes 0..15 `[..., O, I]` -> uint8 `[..., O, I/2]` in GGUF's Q4 nibble order."""
  grouped = np.clip(codes, 0, 15).astype(np.uint8).reshape(*codes.shape[:-1], -1, group_size)
  half = group_size // 2
  packed = grouped[..., :half] | (grouped[..., half:] << 4)  # [..., O, G, g/2]
  return packed.reshape(*codes.shape[:-1], -1)


def quantize_fp8(w: np.ndarray, *, transpose: bool = True) -> QuantizedWeight:
  """float8_e4m3fn codes with a per-output-channel float32 scale."""
  r = _rows(w, transpose)
  scale = (np.abs(r).max(-1) / FP8_MAX).astype(np.float32)
  s = np.where(scale == 0, 1, scale)[..., None]
  q = np.clip(r / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return QuantizedWeight(q=q, scale=scale, kind="fp8", group_size=0)


def fit_group(in_dim: int, group_size: int) -> int:
  """`group_size`, halved until it divides `in_dim` (e.g. 128 -> 64 for SmolLM2's 576)."""
  g = group_size
  while g > 2 and in_dim % g:
    g //= 2
  if in_dim % g or g % 2:
    raise ValueError(f"no even int4 group <= {group_size} divides the input dim {in_dim}")
  return g


def quantize_weight(w: np.ndarray, method: str, *, group_size: int | None = None,
                    transpose: bool = True) -> QuantizedWeight:
  """One weight with `method` in KINDS (int4 group defaults to 64)."""
  if method == "int8":
    return quantize_int8(w, group_size or 0, transpose=transpose)
  if method == "int4":
    in_dim = np.shape(w)[-2 if transpose else -1]
    return quantize_int4(w, fit_group(in_dim, group_size or DEFAULT_INT4_GROUP),
                         transpose=transpose)
  if method == "fp8":
    return quantize_fp8(w, transpose=transpose)
  raise ValueError(f"unsupported quantization {method!r}; supported: {KINDS}")


def quantize_params(params: dict, method: str, *, group_size: int | None = None,
                    embedding: bool = True, calibration: Any = None) -> dict:
  """Quantizes the linear layers (and the LM head / tied embedding) of a params tree.

  Leaves that are already `QuantizedWeight`s (pre-quantized checkpoints) are
  kept. The LM head uses int8 per channel for int8/int4 (it is the most
  sensitive matmul) and fp8 for fp8. MoE expert weights stay as they are.
  With `calibration` (a `serving.quant_calibration.Calibration`), int4 layer
  weights are quantized by GPTQ on the calibration text's activations instead
  of by rounding (same format; see docs/quantization.md); other methods ignore it.
  """
  if method not in KINDS:
    raise ValueError(f"unsupported quantization {method!r}; supported: {KINDS}")
  if calibration is not None and method == "int4":
    from serving import quant_calibration  # noqa: PLC0415  (imports the model code)
    params = quant_calibration.gptq_quantize_layers(params, calibration,
                                                    group_size or DEFAULT_INT4_GROUP)
  quant = lambda w: w if is_quantized(w) else quantize_weight(w, method, group_size=group_size)
  head_method = "fp8" if method == "fp8" else "int8"
  out = dict(params)
  layers = params["layers"]
  if isinstance(layers, dict):
    out["layers"] = {k: quant(v) if k in LINEAR_KEYS else v for k, v in layers.items()}
  else:
    out["layers"] = [{k: quant(v) if k in LINEAR_KEYS else v for k, v in lp.items()}
                     for lp in layers]
  if not embedding:
    return out
  if "lm_head" in params and not is_quantized(params["lm_head"]):
    out["lm_head"] = quantize_weight(params["lm_head"], head_method)
  elif "lm_head" not in params and not is_quantized(params["embed"]):
    # Tied: the embedding table [V, D] is the head's storage [Out, In].
    out["embed"] = quantize_weight(params["embed"], head_method, transpose=False)
  return out


def has_quantized(params: Any) -> bool:
  return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def put_params(params: dict, dtype) -> dict:
  """Device-puts a params tree: float leaves as `dtype`, quantized leaves as stored."""
  def put(a):
    if is_quantized(a):
      return jax.tree.map(jnp.asarray, a)
    return jnp.asarray(a, dtype=dtype)

  return jax.tree.map(put, params, is_leaf=is_quantized)


def params_nbytes(params: Any) -> int:
  """Bytes of every array in a params tree (quantized codes, scales and offsets)."""
  return sum(int(a.nbytes) for a in jax.tree.leaves(params))
