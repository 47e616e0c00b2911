"""Quantized checkpoints: GGUF blocks served as they are, quantized params for orbax.

1. `gguf_quantized_weight(raw)` maps a GGUF Q8_0 / Q4_0 / Q4_1 tensor's raw
   blocks onto a `serving.models.quantized.QuantizedWeight` without going through float:
   the block size 32 becomes the group, the f16 `d` the scale, Q4_1's `m` the
   offset, and the 16 packed bytes of a Q4 block keep their nibble order.
2. `loader.load_gguf_quantized(path, method)` loads a GGUF file for serving
   with `quantization=method`: linear weights (and a tied embedding) whose GGUF
   type matches the method (Q8_0 for int8, Q4_0/Q4_1 for int4; a Q8_0 embedding for both, as
   the LM head stays 8-bit) keep their blocks; every other tensor is
   dequantized and left for `checkpoints.quantizers.quantize_params` (which
   the runner applies) to quantize.
3. `to_saveable` / `from_saveable` turn a params tree with quantized leaves
   into plain nested dicts of arrays plus a JSON spec and back (orbax_io).

`xlaserve convert` additionally quantizes int4 layers by GPTQ before storing
them (serving/tools/gptq.py): an offline step, never done at start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints import gguf as gguf_io
from checkpoints import quantizers
from checkpoints.layout import Params
from serving.models import quantized as quant
from serving.models.model_config import ModelConfig

Q = gguf_io.Q
# GGUF types kept as blocks, per requested method ("gguf": every type we can serve).
BLOCK_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})
KEEP_TYPES = {"int8": frozenset({Q.Q8_0}), "int4": frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K}),
              "fp8": frozenset(), "gguf": BLOCK_TYPES}
# (block size, bytes per block)
_BLOCKS = {Q.Q8_0: (32, 34), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22),
           Q.Q5_1: (32, 24), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210)}


def gguf_quantized_weight(raw: gguf_io.RawTensor) -> quant.QuantizedWeight:
  """A GGUF tensor `[..., Out, In]` (MoE experts: `[E, Out, In]`) of a type in
  `BLOCK_TYPES` as a QuantizedWeight (logical [..., In, Out]) holding the same
  codes and scales, exactly."""
  if raw.ggml_type not in _BLOCKS or len(raw.shape) not in (2, 3):
    raise ValueError(f"cannot keep GGUF tensor {raw.name!r} of type {raw.ggml_type.name} "
                     f"and shape {raw.shape} quantized (supported: "
                     f"{sorted(t.name for t in BLOCK_TYPES)}, 2-D or 3-D)")
  *lead, out_dim, in_dim = raw.shape
  rows = out_dim * int(np.prod(lead, dtype=np.int64))
  size, nbytes = _BLOCKS[raw.ggml_type]
  # [..., Out, G * type_size] -> [rows, G, type_size]
  blocks = np.ascontiguousarray(raw.data).reshape(rows, in_dim // size, nbytes)
  w = _DECODERS[raw.ggml_type](blocks, rows, in_dim)
  if not lead:
    return w
  return quant.QuantizedWeight(
      **{f: a.reshape(*lead, out_dim, *a.shape[1:]) for f, a in w.arrays().items()},
      kind=w.kind, group_size=w.group_size, super_size=w.super_size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
  return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]


def _bytes(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
  return np.ascontiguousarray(blocks[..., start:stop])


def _q8_0(blocks, out_dim, in_dim):
  q = _bytes(blocks, 2, 34).view(np.int8).reshape(out_dim, in_dim)
  return quant.QuantizedWeight(q=q, scale=_f16(blocks, 0), kind="int8", group_size=32)


def _q4_legacy(blocks, out_dim, in_dim):
  """Q4_0 (d, 16 bytes) and Q4_1 (d, m, 16 bytes): our int4 nibble order already."""
  with_min = blocks.shape[-1] == 20
  packed = _bytes(blocks, 4 if with_min else 2, blocks.shape[-1]).reshape(out_dim, in_dim // 2)
  return quant.QuantizedWeight(q=packed, scale=_f16(blocks, 0),
                               offset=_f16(blocks, 2) if with_min else None, kind="int4",
                               group_size=32)


def _q5_legacy(blocks, out_dim, in_dim):
  """Q5_0 (d, qh, 16 bytes) and Q5_1 (d, m, qh, 16 bytes): input e's fifth bit is bit e
  of the little-endian 32-bit qh, i.e. our 1-bit plane as it is."""
  with_min = blocks.shape[-1] == 24
  at = 4 if with_min else 2
  q_high = _bytes(blocks, at, at + 4).reshape(out_dim, in_dim // 8)
  packed = _bytes(blocks, at + 4, at + 20).reshape(out_dim, in_dim // 2)
  return quant.QuantizedWeight(q=packed, q_high=q_high, scale=_f16(blocks, 0),
                               offset=_f16(blocks, 2) if with_min else None, kind="int5",
                               group_size=32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (uint8 [..., 8] each).

  Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7;
  bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of scales 4-7
  (low nibble) and mins 4-7 (high nibble).
  """
  a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
  scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
  mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
  return scales, mins


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
  """128 bytes per 256 inputs -> codes 0..15 [..., 256]: each 32 bytes hold 64
  inputs, the first 32 in the low nibbles and the next 32 in the high ones."""
  chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
  return ((chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(
      *qs.shape[:-1], 256)


def _q4_k(blocks, out_dim, in_dim):
  """Q4_K (d, dmin, 12 bytes of scales/mins, 128 bytes): w = d*sc*q - dmin*m per 32."""
  return _k_quant(blocks, out_dim, in_dim, _k_low_nibbles(_bytes(blocks, 16, 144)), None)


def _q5_k(blocks, out_dim, in_dim):
  """Q5_K (d, dmin, 12 bytes, qh 32 bytes, 128 bytes): input j*32 + l's fifth bit is
  bit j of qh[l]."""
  qh = _bytes(blocks, 16, 48)
  high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
  return _k_quant(blocks, out_dim, in_dim, _k_low_nibbles(_bytes(blocks, 48, 176)),
                  high.reshape(*qh.shape[:-1], 256))


def _k_quant(blocks, out_dim, in_dim, low, high):
  scales, mins = _k_scale_min(_bytes(blocks, 4, 16))
  codes = low if high is None else low | (high << 4)  # [Out, G256, 256]
  codes = codes.reshape(out_dim, in_dim)
  kind = "int4" if high is None else "int5"
  return quant.QuantizedWeight(
      q=quantizers.pack_int4(codes & 0x0F, 32),
      q_high=None if high is None else pack_high_bits(codes >> 4, 1),
      scale=scales.reshape(out_dim, -1), offset=mins.reshape(out_dim, -1),
      super_scale=_f16(blocks, 0), super_offset=-_f16(blocks, 2),
      kind=kind, group_size=32, super_size=256)


def _q6_k(blocks, out_dim, in_dim):
  """Q6_K (ql 128 bytes, qh 64 bytes, 16 int8 scales, d): w = d * sc * (q - 32) per 16.

  Per 128 inputs, 64 bytes of ql hold inputs 0-63 in their low nibbles and
  64-127 in their high ones; input t*32 + l's top 2 bits are bits 2t, 2t+1
  of the half's qh[l].
  """
  ql = _bytes(blocks, 0, 128).reshape(out_dim, -1, 2, 1, 64)
  low = (ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # [O, G, 2, 2, 64]
  qh = _bytes(blocks, 128, 192).reshape(out_dim, -1, 2, 1, 32)
  high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # [O, G, 2, 4, 32]
  codes = (low.reshape(out_dim, in_dim) | (high.reshape(out_dim, in_dim) << 4))
  return quant.QuantizedWeight(
      q=quantizers.pack_int4(codes & 0x0F, 16), q_high=pack_high_bits(codes >> 4, 2),
      scale=_bytes(blocks, 192, 208).view(np.int8).reshape(out_dim, -1),
      super_scale=_f16(blocks, 208), kind="int6", group_size=16, super_size=256)


def pack_high_bits(high: np.ndarray, bits: int) -> np.ndarray:
  """The code bits above the low nibble, [..., I] -> uint8 [..., I*bits/8]: byte k holds
  inputs k*8/bits onward, `bits` each from the lowest (QuantizedWeight.q_high)."""
  per = 8 // bits
  grouped = high.astype(np.uint8).reshape(*high.shape[:-1], -1, per)
  shifts = (np.arange(per) * bits).astype(np.uint8)
  return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


_DECODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_legacy, Q.Q4_1: _q4_legacy, Q.Q5_0: _q5_legacy,
             Q.Q5_1: _q5_legacy, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def stack_blocks(weights: list[quant.QuantizedWeight]) -> quant.QuantizedWeight | None:
  """Per-layer weights -> one [L, ...] weight; None if their layouts differ."""
  layout = lambda w: (w.kind, w.group_size, w.super_size, tuple(w.arrays()))
  first = weights[0]
  if any(layout(w) != layout(first) or w.q.shape != first.q.shape for w in weights):
    return None
  arrays = {f: np.stack([getattr(w, f) for w in weights]) for f in first.arrays()}
  return quant.QuantizedWeight(**arrays, kind=first.kind, group_size=first.group_size,
                               super_size=first.super_size)


def kept_keys(cfg: ModelConfig) -> tuple[str, ...]:
  """Params keys whose GGUF tensors can stay quantized (the router stays float)."""
  if cfg.is_moe:
    return ("wq", "wk", "wv", "wo", *quant.EXPERT_KEYS)
  return quant.LINEAR_KEYS


def to_saveable(params: Params) -> tuple[Params, dict[str, Any]]:
  """Quantized leaves -> dicts of their arrays; spec {path: {kind, group_size, super_size}}."""
  spec: dict[str, Any] = {}

  def walk(tree, prefix):
    if quant.is_quantized(tree):
      spec[prefix] = {"kind": tree.kind, "group_size": tree.group_size,
                      "super_size": tree.super_size}
      return tree.arrays()
    if isinstance(tree, dict):
      return {k: walk(v, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):  # per-layer layers (mixed GGUF block types)
      return [walk(v, f"{prefix}/{i}") for i, v in enumerate(tree)]
    return tree

  return walk(params, ""), spec


def from_saveable(params: Params, spec: dict[str, Any]) -> Params:
  """Inverse of `to_saveable`."""
  def walk(tree, prefix):
    if prefix in spec:
      return quant.QuantizedWeight(**{f: tree.get(f) for f in quant.FIELDS}, **spec[prefix])
    if isinstance(tree, dict):
      return {k: walk(v, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
      return [walk(v, f"{prefix}/{i}") for i, v in enumerate(tree)]
    return tree

  return walk(params, "")
