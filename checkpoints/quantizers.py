"""Host-side weight quantizers: numpy in, numpy-backed `QuantizedWeight` out.

Round-to-nearest formats of `serving.models.quantized.QuantizedWeight`
(its module doc has the layouts): int8 in groups (32 by default, llama.cpp's
Q8_0) or per channel, int4 in groups with a least-squares fitted min + scale,
fp8 per channel.
`quantize_params` applies one method to every linear leaf of a params tree
(docs/structure.md) and keeps leaves that are already quantized, so GPTQ
layers (serving/tools/gptq.py) and kept GGUF blocks pass through.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from serving.models.quantized import (
  DEFAULT_INT4_GROUP,
  DEFAULT_INT8_GROUP,
  EXPERT_KEYS,
  FP8_MAX,
  LINEAR_KEYS,
  METHODS,
  QuantizedWeight,
  is_quantized,
)


def weight_rows(w: np.ndarray, transpose: bool) -> np.ndarray:
  """Float32 `[..., Out, In]` from a `[..., In, Out]` weight (or as is)."""
  w = np.asarray(w).astype(np.float32)
  return np.swapaxes(w, -1, -2) if transpose else w


def quantize_int8(w: np.ndarray, group_size: int = 0, *, asymmetric: bool = True,
                  transpose: bool = True) -> QuantizedWeight:
  """int8 of a `[..., In, Out]` weight (`transpose=False`: already `[..., Out, In]`).

  Per output channel (`group_size=0`): symmetric int8 codes, absmax / 127.
  In groups: by default uint8 codes on 256 levels from the group's min to its
  max (float16 scale and min: `w = code * scale + min`); `asymmetric=False`
  gives GGUF Q8_0's symmetric int8 codes with one float16 scale.
  """
  r = weight_rows(w, transpose)
  if not group_size:
    scale = (np.abs(r).max(-1) / 127.0).astype(np.float32)
    s = np.where(scale == 0, 1, scale)[..., None]
    q = np.clip(np.rint(r / s), -127, 127).astype(np.int8)
    return QuantizedWeight(q=q, scale=scale, kind="int8", group_size=0)
  grouped = r.reshape(*r.shape[:-1], -1, group_size)  # [..., O, G, g]
  if asymmetric:
    lo = grouped.min(-1).astype(np.float16)
    scale = ((grouped.max(-1) - lo.astype(np.float32)) / 255.0).astype(np.float16)
    s = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    q = np.clip(np.rint((grouped - lo.astype(np.float32)[..., None]) / s), 0, 255)
    return QuantizedWeight(q=q.astype(np.uint8).reshape(r.shape), scale=scale, offset=lo,
                           kind="int8", group_size=group_size)
  scale = (np.abs(grouped).max(-1) / 127.0).astype(np.float16)
  s = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
  q = np.clip(np.rint(grouped / s), -127, 127).astype(np.int8).reshape(r.shape)
  return QuantizedWeight(q=q, scale=scale, kind="int8", group_size=group_size)


def fit_min_scale(grouped, refine: int, xp=np, weights=None):
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
  r = weight_rows(w, transpose)
  if r.shape[-1] % group_size:
    raise ValueError(f"group_size={group_size} must divide the input dim {r.shape[-1]}")
  grouped = r.reshape(*r.shape[:-1], -1, group_size)  # [..., O, G, g]
  if asymmetric:
    scale, offset = fit_min_scale(grouped, refine)
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
  r = weight_rows(w, transpose)
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
  """One weight with `method` int8 (groups of 32 by default, as Q8_0; `group_size=0`:
  per channel), int4 (groups of 64) or fp8 (per channel)."""
  in_dim = np.shape(w)[-2 if transpose else -1]
  if method == "int8":
    group = DEFAULT_INT8_GROUP if group_size is None else group_size
    return quantize_int8(w, group and fit_group(in_dim, group), transpose=transpose)
  if method == "int4":
    return quantize_int4(w, fit_group(in_dim, group_size or DEFAULT_INT4_GROUP),
                         transpose=transpose)
  if method == "fp8":
    return quantize_fp8(w, transpose=transpose)
  raise ValueError(f"unsupported quantization {method!r}; supported: int8, int4, fp8")


def quantize_params(params: dict, method: str, *, group_size: int | None = None,
                    embedding: bool = True) -> dict:
  """Quantizes the linear layers (and the LM head / tied embedding) of a params tree.

  Leaves that are already `QuantizedWeight`s (pre-quantized checkpoints, GPTQ
  layers, GGUF blocks) are kept. MoE experts are quantized like the dense
  linears; the router stays float. The LM head uses int8 in groups of 32 for
  int8/int4 (it is the most sensitive matmul) and fp8 for fp8. `gguf` (serve a
  GGUF's blocks as stored) quantizes nothing more.
  """
  if method not in METHODS:
    raise ValueError(f"unsupported quantization {method!r}; supported: {METHODS}")
  if method == "gguf":
    return params
  quant = lambda w: w if is_quantized(w) else quantize_weight(w, method, group_size=group_size)
  head_method = "fp8" if method == "fp8" else "int8"
  keys = (*LINEAR_KEYS, *EXPERT_KEYS)
  out = dict(params)
  layers = params["layers"]
  if isinstance(layers, dict):
    out["layers"] = {k: quant(v) if k in keys else v for k, v in layers.items()}
  else:
    out["layers"] = [{k: quant(v) if k in keys else v for k, v in lp.items()}
                     for lp in layers]
  if not embedding:
    return out
  if "lm_head" in params and not is_quantized(params["lm_head"]):
    out["lm_head"] = quantize_weight(params["lm_head"], head_method)
  elif "lm_head" not in params and not is_quantized(params["embed"]):
    # Tied: the embedding table [V, D] is the head's storage [Out, In].
    out["embed"] = quantize_weight(params["embed"], head_method, transpose=False)
  return out


