"""The fused decoder-stack custom call: every layer of a decode step in one native call.

`decode_layers(x, ...)` runs L Llama-family layers (RMSNorm, Q/K/V, RoPE,
the K/V write into the page pool, paged attention, the output projection,
RMSNorm, SwiGLU, residuals) over a few rows `x [B, D]` float32, with every
linear weight given as quantized groups of 32 as stored (`FORMATS`) and the
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

from kernels_cpu.library import available

# (code bits, has a min) -> the kernel's format code (quant_dot.h `Format`)
FORMATS = {(8, True): 0, (8, False): 1, (4, True): 2, (4, False): 3}
# Added to a nibble or Q8_0 format: activations rounded per group to 8 or 16 bits (VNNI).
ACTIVATION_FLAGS = {32: 0, 8: 4, 16: 8}
PAGE_KINDS = {"float32": 0, "bfloat16": 1}
WEIGHTS_PER_LAYER = 7  # wq, wk, wv, wo, w_gate, w_up, w_down
MAX_ROWS = 32  # rows one decode step takes (decoder.cc's kMaxRows; matvec takes more)

__all__ = ["ACTIVATION_FLAGS", "FORMATS", "MAX_ROWS", "PAGE_KINDS", "WEIGHTS_PER_LAYER",
           "decode_layers", "enabled"]


def enabled() -> bool:
  """The native kernels are available and `XLASERVE_NATIVE_LAYERS` is not 0."""
  return available() and os.environ.get("XLASERVE_NATIVE_LAYERS", "1") != "0"


def decode_layers(x: jax.Array, positions: jax.Array, kv_index: jax.Array, tables: jax.Array,
                  seq_lens: jax.Array, inv_freq: jax.Array, norms: jax.Array,
                  k_pool: jax.Array, v_pool: jax.Array,
                  weights: Sequence[tuple[jax.Array, jax.Array, jax.Array | None]],
                  formats: Sequence[int], *, num_heads: int, num_pages: int, window: int,
                  page_kind: int, eps: float, scale: float
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """-> (h [B, D] float32, k_pool, v_pool).

  x [B, D] f32; positions, kv_index (page * page_size + offset), seq_lens [B] int32;
  tables [B, W] int32 per-layer page ids; inv_freq [H/2] f32; norms [L, 2, D] f32
  (attention, MLP); pools [L*P, page_size, K, H]; weights: L*7 (codes, scale f16,
  offset f16 or None) stored [O, I*bits/8] / [O, I/32], in the order wq, wk, wv, wo,
  w_gate, w_up, w_down per layer; formats: one `FORMATS` code per weight (plus its
  `ACTIVATION_FLAGS`).
  """
  operands = [x.astype(jnp.float32), positions.astype(jnp.int32), kv_index.astype(jnp.int32),
              tables.astype(jnp.int32), seq_lens.astype(jnp.int32), inv_freq.astype(jnp.float32),
              norms.astype(jnp.float32), k_pool, v_pool]
  for codes, scale_, offset in weights:
    operands += [codes, scale_, scale_ if offset is None else offset]
  call = jax.ffi.ffi_call(
      "xlaserve_decode_layers",
      (jax.ShapeDtypeStruct(x.shape, jnp.float32),
       jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
       jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
      input_output_aliases={7: 1, 8: 2})
  return call(*operands, formats=np.asarray(formats, np.int64), num_heads=np.int64(num_heads),
              num_pages=np.int64(num_pages), window=np.int64(window),
              kind=np.int64(page_kind), eps=np.float32(eps), scale=np.float32(scale))
