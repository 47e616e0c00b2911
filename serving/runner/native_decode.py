"""A decode step's layers in one native call (kernels_cpu.decoder), where they fit.

`runs_native(layers, cfg, kv, rows, lora)` says whether a decode step of
`rows` rows takes the fused custom call instead of `causal_lm.run_layers`: on CPU,
one device, the native kernels enabled, a dense Llama-family model without
QKV bias, Q/K norms or hybrid attention (one window for every layer), with
RoPE on whole heads and unscaled cos / sin, no LoRA, unrolled layers whose
seven linear weights all run the native matvec at this row count (quantized
groups of 32 as stored: GGUF Q4_1 / Q4_0 / Q8_0, our int8), float32
activations and a float32 or bfloat16 KV pool. Everything else (prefill,
verification, larger batches, other models) runs op by op, as before; both
paths compute the same values (tests/serving/runner/test_native_decode.py).

`run_layers(...)` has `causal_lm.run_layers`' contract for a decode step:
h [B, D] -> (h, kv), the K/V of each row written at its `kv_index`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from kernels_cpu import decoder
from serving.models import layers as model_layers
from serving.models.model_config import ModelConfig
from serving.models.quantized import is_quantized
from serving.runner.kv_cache import KVCache

LINEAR_ORDER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the kernel's order
# Families whose layer is the kernel's: pre-norm RMSNorm, RoPE, attention, SwiGLU (Phi-3's
# fused projections arrive split; its partial rotary and LongRoPE are refused below).
NATIVE_FAMILIES = ("llama", "phi3")


def runs_native(layers: Any, cfg: ModelConfig, kv: KVCache, x: jax.Array, lora: Any) -> bool:
  """Whether `run_layers` takes this decode step (see module doc); x [B, D]."""
  if (jax.default_backend() != "cpu" or not decoder.enabled() or lora is not None
      or cfg.family not in NATIVE_FAMILIES or cfg.is_hybrid or cfg.attention_sinks
      or cfg.attn_soft_cap is not None or cfg.attn_scale is not None
      or cfg.is_moe or cfg.qkv_bias or cfg.qk_norm or x.dtype != jnp.float32
      or cfg.rotary_dim != cfg.head_dim or model_layers.rope_attention_scale(cfg) != 1.0
      or kv.dtype not in decoder.PAGE_KINDS or not isinstance(layers, (list, tuple))):
    return False
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    return False
  rows = x.shape[0]
  if rows > decoder.MAX_ROWS or cfg.head_dim % 16 or kv.head_dim != cfg.head_dim:
    return False
  for lp in layers:
    for name in LINEAR_ORDER:
      w = lp.get(name)
      if not is_quantized(w) or not w.runs_native(rows):
        return False
    if not all(name in lp for name in ("attn_norm", "mlp_norm")):
      return False
  return True


def _format(w) -> int:
  code = decoder.FORMATS[(w.bits, w.offset is not None)]
  return code + decoder.ACTIVATION_FLAGS[w.native_activation_bits(1)]


def run_layers(layers: list, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
               meta: dict, kv: KVCache) -> tuple[jax.Array, KVCache]:
  """The decode step's layers over x [B, D] in one call -> (h [B, D], kv); `meta` holds
  the step's kv_index, block_tables (per-layer page ids) and seq_lens."""
  norms = jnp.stack([jnp.stack([lp["attn_norm"], lp["mlp_norm"]]).astype(jnp.float32)
                     for lp in layers])
  weights, formats = [], []
  for lp in layers:
    for name in LINEAR_ORDER:
      w = lp[name]
      weights.append((w.q, w.scale, w.offset))
      formats.append(_format(w))
  h, k, v = decoder.decode_layers(
      x, positions, meta["kv_index"], meta["block_tables"], meta["seq_lens"],
      jnp.asarray(model_layers.rope_inv_freq(cfg)), norms, kv.k, kv.v, weights, formats,
      num_heads=cfg.num_heads, num_pages=kv.num_pages, window=cfg.layer_windows[0] or 0,
      page_kind=decoder.PAGE_KINDS[kv.dtype], eps=cfg.rms_norm_eps,
      scale=cfg.head_dim ** -0.5)
  return h.astype(x.dtype), KVCache(k=k, v=v, num_pages=kv.num_pages, dtype=kv.dtype)
