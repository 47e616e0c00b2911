"""A step's layers in one native call (kernels_cpu.decoder), where they fit.

`runs_native(layers, cfg, kv, rows, lora)` says whether a decode, verify or prefill step
of `rows` rows (up to kernels_cpu.decoder.MAX_ROWS) takes the fused custom call instead of
`causal_lm.run_layers`: on CPU,
one device, the native kernels enabled, a dense Llama-family model without
QKV bias, Q/K norms or hybrid attention (one window for every layer), with
RoPE on whole heads and unscaled cos / sin, no LoRA, unrolled layers whose
seven linear weights the native matvec reads (quantized blocks as stored: GGUF
Q4_1 / Q4_0 / Q8_0 and our int8 in groups of 32, GGUF Q4_K / Q5_K / Q6_K), float32
activations and a float32 or bfloat16 KV pool. Everything else (larger steps, other
models, meshes) runs op by op; both paths compute the same values up to summation
order (tests/serving/runner/test_native_decode.py).

A verify step (speculative decoding) is decode rows too: its B sequences of
S positions are B * S rows, each with its own position, K/V index, the
sequence's block table and `seq_len = position + 1` (`verify_rows`). The
kernel writes the K/V of every row of a layer before any row of it attends,
so position j sees the drafts before it, as `attention.verify_attention` does.
A prefill step is the same: each packed token a row with its chunk's block table
(`prefill_rows`); rows sharing a table attend together (kernels_cpu attention spans).

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
from serving.models.quantized import NATIVE_ROWS_BESIDE_FULL, is_quantized, kquant_format
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
      if not _reads_codes(lp.get(name), rows):
        return False
    if not all(name in lp for name in ("attn_norm", "mlp_norm")):
      return False
  return True


def _reads_codes(w: Any, rows: int) -> bool:
  """`w` is a weight the kernel reads at `rows` rows: quantized, in a format the native
  matvec takes (asked at one row: the fused call has its own row limit, above the per-op
  kernel's), and beside a dense copy only up to the rows the copy leaves to the codes."""
  return (is_quantized(w) and w.runs_native(1)
          and (w.full is None or rows <= NATIVE_ROWS_BESIDE_FULL))


def verify_rows(meta: dict) -> dict:
  """A verify step's attention metadata (steps.verify_step: kv_index [B*S], block_tables
  [B, W], q_lens [B, S] = keys each position attends to, 0 past its drafts) as the
  decode rows `run_layers` takes: one row per position, the sequence's table repeated."""
  q_lens = meta["q_lens"]
  return dict(kv_index=meta["kv_index"], seq_lens=q_lens.reshape(-1),
              block_tables=jnp.repeat(meta["block_tables"], q_lens.shape[1], axis=0))


def prefill_rows(meta: dict, positions: jax.Array) -> dict:
  """A prefill step's attention metadata (steps.prefill_meta: kv_index [T], the chunks'
  block_tables [C, W] and cu_q_lens [C+1]) as the decode rows `run_layers` takes: each
  packed token a row with its chunk's table, attending to the keys up to its own
  position (seq_len = position + 1; 0 for the padding after the last chunk)."""
  cu = meta["cu_q_lens"]
  t = jnp.arange(positions.shape[0], dtype=cu.dtype)
  chunk = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, cu.shape[0] - 2)
  return dict(kv_index=meta["kv_index"], block_tables=meta["block_tables"][chunk],
              seq_lens=jnp.where(t < cu[-1], positions + 1, 0).astype(jnp.int32))


def _format(w) -> int:
  fmt = kquant_format(w)
  code = decoder.FORMATS[(w.bits, w.offset is not None)] if fmt is None else (
      decoder.K_FORMATS[fmt])
  tiles = decoder.TILED_FLAG if w.layout == "tiles" else 0
  return code + decoder.ACTIVATION_FLAGS[w.native_activation_bits(1)] + tiles


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
      weights.append((w.q, w.scale, w.offset, w.q_high, w.super_scale, w.super_offset))
      formats.append(_format(w))
  h, k, v = decoder.decode_layers(
      x, positions, meta["kv_index"], meta["block_tables"], meta["seq_lens"],
      jnp.asarray(model_layers.rope_inv_freq(cfg)), norms, kv.k, kv.v, weights, formats,
      num_heads=cfg.num_heads, num_pages=kv.num_pages, window=cfg.layer_windows[0] or 0,
      page_kind=decoder.PAGE_KINDS[kv.dtype], eps=cfg.rms_norm_eps,
      scale=cfg.head_dim ** -0.5)
  return h.astype(x.dtype), KVCache(k=k, v=v, num_pages=kv.num_pages, dtype=kv.dtype)
