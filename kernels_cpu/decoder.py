"""The fused decoder-stack custom call: every layer of a decode step in one native call.

`decode_layers(x, ...)` runs L Llama-family layers (RMSNorm, Q/K/V, RoPE,
the K/V write into the page pool, paged attention, the output projection,
RMSNorm, SwiGLU, residuals) over rows `x [B, D]` float32 (B <= MAX_ROWS: decode
rows, or a verify step's positions, each row its own position and keys), with every
linear weight given as quantized blocks as stored (`FORMATS`: groups of 32;
`K_FORMATS`: GGUF Q4_K / Q5_K / Q6_K, kernels_cpu/kquant_dot.h) and the
pools float32 or bfloat16 (as uint16). The pools are updated in place: they
are aliased to the second and third outputs, so inside a step that donates
them no copy is made.

One call instead of ~8 per layer: the per-op path (QuantizedWeight.matmul +
paged_attention) wakes XLA's pool threads for every matvec of ~50-100 us;
here the helpers stay for the whole stack (decoder.cc). Valid only where
`enabled()`; the caller (serving/runner/native_decode.py) checks the model
and operands and otherwise runs the layers op by op. `XLASERVE_NATIVE_LAYERS=0`
turns it off (the per-op native kernels stay).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.library import available, target

# (code bits, has a min) -> the kernel's format code (quant_dot.h `Format`)
FORMATS = {(8, True): 0, (8, False): 1, (4, True): 2, (4, False): 3}
# K-quant (kernels_cpu.matvec.K_FORMATS) -> the kernel's format code
K_FORMATS = {"q4_k": 4, "q5_k": 5, "q6_k": 6}
# Added to a nibble, Q8_0 or K-quant format: activations rounded per group to 8 or 16 bits
# (VNNI).
ACTIVATION_FLAGS = {32: 0, 8: 16, 16: 32}
# Added to a Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K format with integer activations: the weight
# is in the column-tiled layout (kernels_cpu/matvec.py `tile_columns`; the AVX-512 set only).
TILED_FLAG = 64
OPERANDS_PER_WEIGHT = 6  # codes, scale, offset, q_high, super_scale, super_offset
PAGE_KINDS = {"float32": 0, "bfloat16": 1}
WEIGHTS_PER_LAYER = 7  # wq, wk, wv, wo, w_gate, w_up, w_down
# Rows a call takes (decoder.cc kMaxDecoderRows): decode rows, or a verify step's
# sequences x (k + 1) positions.
MAX_ROWS = 1024

__all__ = ["ACTIVATION_FLAGS", "FORMATS", "K_FORMATS", "MAX_ROWS", "OPERANDS_PER_WEIGHT",
           "PAGE_KINDS", "TILED_FLAG", "WEIGHTS_PER_LAYER", "decode_layers", "enabled"]


def enabled() -> bool:
  """The native kernels are available and `XLASERVE_NATIVE_LAYERS` is not 0."""
  return available() and os.environ.get("XLASERVE_NATIVE_LAYERS", "1") != "0"


def decode_layers(x: jax.Array, positions: jax.Array, kv_index: jax.Array, tables: jax.Array,
                  seq_lens: jax.Array, inv_freq: jax.Array, norms: jax.Array,
                  k_pool: jax.Array, v_pool: jax.Array,
                  weights: Sequence[tuple[jax.Array | None, ...]],
                  formats: Sequence[int], *, num_heads: int, num_pages: int, window: int,
                  page_kind: int, eps: float, scale: float
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """-> (h [B, D] float32, k_pool, v_pool).

  x [B, D] f32; positions, kv_index (page * page_size + offset), seq_lens [B] int32;
  tables [B, W] int32 per-layer page ids; inv_freq [H/2] f32; norms [L, 2, D] f32
  (attention, MLP); pools [L*P, page_size, K, H]; weights: L*7 tuples (codes, scale,
  offset, q_high, super_scale, super_offset), None where a format has no such operand
  (groups of 32: codes [O, I*bits/8], scale and offset f16 [O, I/32]; K-quants: the
  QuantizedWeight fields as stored), in the order wq, wk, wv, wo, w_gate, w_up, w_down
  per layer; formats: one `FORMATS` or `K_FORMATS` code per weight (plus its
  `ACTIVATION_FLAGS`, and `TILED_FLAG` for a weight in the column-tiled layout).
  """
  operands = [x.astype(jnp.float32), positions.astype(jnp.int32), kv_index.astype(jnp.int32),
              tables.astype(jnp.int32), seq_lens.astype(jnp.int32), inv_freq.astype(jnp.float32),
              norms.astype(jnp.float32), k_pool, v_pool]
  for weight in weights:
    codes, scale_, offset, q_high, super_scale, super_offset = (
        tuple(weight) + (None,) * OPERANDS_PER_WEIGHT)[:OPERANDS_PER_WEIGHT]
    # An operand the format lacks: the scales again (groups of 32) or the scale codes.
    operands += [codes, scale_, scale_ if offset is None else offset,
                 codes if q_high is None else q_high,
                 scale_ if super_scale is None else super_scale,
                 (scale_ if super_scale is None else super_scale) if super_offset is None
                 else super_offset]
  call = jax.ffi.ffi_call(
      target("xlaserve_decode_layers"),
      (jax.ShapeDtypeStruct(x.shape, jnp.float32),
       jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
       jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
      input_output_aliases={7: 1, 8: 2})
  return call(*operands, formats=np.asarray(formats, np.int64), num_heads=np.int64(num_heads),
              num_pages=np.int64(num_pages), window=np.int64(window),
              kind=np.int64(page_kind), eps=np.float32(eps), scale=np.float32(scale))
