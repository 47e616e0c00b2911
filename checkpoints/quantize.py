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
from checkpoints.layout import Params
from serving.models import quantized as quant
from serving.models.model_config import ModelConfig

Q = gguf_io.Q
# GGUF types kept as blocks, per requested method.
KEEP_TYPES = {"int8": frozenset({Q.Q8_0}), "int4": frozenset({Q.Q4_0, Q.Q4_1}),
              "fp8": frozenset()}
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}


def gguf_quantized_weight(raw: gguf_io.RawTensor) -> quant.QuantizedWeight:
  """A 2-D Q8_0 / Q4_0 / Q4_1 tensor `[Out, In]` as a QuantizedWeight (logical [In, Out])."""
  if raw.ggml_type not in _BLOCK_BYTES or len(raw.shape) != 2:
    raise ValueError(f"cannot keep GGUF tensor {raw.name!r} of type {raw.ggml_type.name} "
                     f"and shape {raw.shape} quantized (supported: Q8_0, Q4_0, Q4_1, 2-D)")
  out_dim, in_dim = raw.shape
  # [Out, G * type_size] -> [Out, G, type_size]
  blocks = np.ascontiguousarray(raw.data).reshape(out_dim, in_dim // 32,
                                                  _BLOCK_BYTES[raw.ggml_type])
  f16 = lambda at: np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]
  if raw.ggml_type == Q.Q8_0:
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_dim, in_dim)
    return quant.QuantizedWeight(q=q, scale=f16(0), kind="int8", group_size=32)
  start = 2 if raw.ggml_type == Q.Q4_0 else 4
  packed = np.ascontiguousarray(blocks[..., start:]).reshape(out_dim, in_dim // 2)
  offset = f16(2) if raw.ggml_type == Q.Q4_1 else None
  return quant.QuantizedWeight(q=packed, scale=f16(0), offset=offset, kind="int4", group_size=32)


def stack_blocks(weights: list[quant.QuantizedWeight]) -> quant.QuantizedWeight | None:
  """Per-layer weights -> one [L, ...] weight; None if their layouts differ."""
  first = weights[0]
  if any((w.kind, w.group_size, w.offset is None) != (first.kind, first.group_size,
                                                      first.offset is None) for w in weights):
    return None
  arrays = {f: None if getattr(first, f) is None else np.stack([getattr(w, f) for w in weights])
            for f in ("q", "scale", "offset")}
  return quant.QuantizedWeight(**arrays, kind=first.kind, group_size=first.group_size)


def kept_keys(cfg: ModelConfig) -> tuple[str, ...]:
  return quant.LINEAR_KEYS if not cfg.is_moe else ("wq", "wk", "wv", "wo")


def to_saveable(params: Params) -> tuple[Params, dict[str, Any]]:
  """Quantized leaves -> {"q", "scale"[, "offset"]} dicts; spec {path: {kind, group_size}}."""
  spec: dict[str, Any] = {}

  def walk(tree, prefix):
    if quant.is_quantized(tree):
      spec[prefix] = {"kind": tree.kind, "group_size": tree.group_size}
      return {f: getattr(tree, f) for f in ("q", "scale", "offset") if getattr(tree, f) is not None}
    if isinstance(tree, dict):
      return {k: walk(v, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}
    return tree

  return walk(params, ""), spec


def from_saveable(params: Params, spec: dict[str, Any]) -> Params:
  """Inverse of `to_saveable`."""
  def walk(tree, prefix):
    if prefix in spec:
      return quant.QuantizedWeight(q=tree["q"], scale=tree["scale"], offset=tree.get("offset"),
                                   **spec[prefix])
    if isinstance(tree, dict):
      return {k: walk(v, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}
    return tree

  return walk(params, "")
