"""Attention over a latent KV cache (multi-head latent attention, DeepSeek-V2/V3).

The pool (kv_cache.py) holds one row per token per layer: the normed latent
c [R] then the roped key k_pe [r] (`k` [L*P, page_size, 1, R + r]; `v` is
empty). The model (serving/models/deepseek.py) gives absorbed queries
q [T, N, R + r]: each head's nope part mapped into the latent space, then its
roped part. So attention is multi-query attention with one key head whose
values are the first R dims of the keys: scores q . row, output the
softmax-weighted latents [T, N, R]; the model maps them out per head.

Every step kind reads the cache this way (decode, verification, prefill
chunks): `latent_multi_query_attention` is the one XLA loop (flash-style over
blocks of pages, up to the longest row's length); prefill chunks run it per
query block of one chunk (`QueryBlocks`, as attention.py's blocked prefill)
or, without blocks, as one-query rows. The Pallas backends run the decode
rows through `kernels_pallas.mla_decode_attention` (GPU; Pallas interpret mode
on CPU; TPU and int8 / fp8 pools take the XLA loop) and the rest through the same XLA
loop (interpret mode checks the kernel against it on CPU).

Letters: B rows, T queries per row, N heads, C = R + r the row width, R the
latent (value) width, S keys in a block, W block-table width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from serving.runner.attention import (
  QueryBlocks,
  _block_pages,
  _gather_pages,
  _online_softmax_update,
  _softmax_init,
  packed_row_keys,
)
from serving.runner.kv_cache import (
  QUANTIZED_DTYPES,
  KVCache,
  _to_storage,
  from_storage,
  layer_base,
  layer_pages,
)


def write_latent(kv: KVCache, layer, latent: jax.Array, kv_index: jax.Array) -> KVCache:
  """Scatters new rows latent [T, 1, C] into the layer's slots `kv_index` [T] (page 0:
  padding)."""
  ps = kv.k.shape[1]
  page = layer_base(kv, layer) + kv_index // ps
  return dataclasses.replace(kv, k=kv.k.at[page, kv_index % ps].set(_to_storage(latent, kv)))


def latent_multi_query_attention(q: jax.Array, kv: KVCache, block_tables: jax.Array,
                                 q_lens: jax.Array, *, scale: float, value_dim: int,
                                 block_tokens: int = 128) -> jax.Array:
  """q [B, T, N, C]; block_tables [B, W] (layer-offset); q_lens [B, T] keys each query
  sees (0: none, output zeros) -> [B, T, N, value_dim] in q's dtype.

  A loop over blocks of `block_tokens` keys up to the longest row; each block's rows
  are gathered once for all T * N queries of a row (one key head).
  """
  b, t, n, c = q.shape
  ps = kv.k.shape[1]
  bp = _block_pages(block_tables.shape[1], ps, block_tokens)
  span = bp * ps
  qf = q.reshape(b, t * n, c).astype(kv.compute_dtype)
  lens = jnp.repeat(q_lens, n, axis=1)  # [B, T*N] in (T, N) order

  def body(i, carry):
    tables = jax.lax.dynamic_slice_in_dim(block_tables, i * bp, bp, axis=1)
    k = _gather_pages(kv.k, tables, kv)[:, :, 0, :]  # [B, S, C]
    s = jnp.einsum("bqc,bsc->bqs", qf, k, preferred_element_type=jnp.float32) * scale
    pos = i * span + jnp.arange(span)
    valid = pos[None, None, :] < lens[:, :, None]  # [B, T*N, S]
    v = jnp.where(jnp.any(valid, axis=1)[:, :, None], k[..., :value_dim], 0)  # NaN-safe
    return _online_softmax_update(carry, s, v, valid)

  m, l = _softmax_init((b, t * n), None)
  init = (m, l, jnp.zeros((b, t * n, value_dim), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, (jnp.max(q_lens) + span - 1) // span, body, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]
  return out.reshape(b, t, n, value_dim).astype(q.dtype)


def latent_block_prefill_attention(q: jax.Array, kv: KVCache, block_tables: jax.Array,
                                   blocks: QueryBlocks, *, scale: float, value_dim: int,
                                   block_tokens: int = 128) -> jax.Array:
  """Prefill chunks' packed rows q [T, N, C] (causal), block by block of one chunk
  (`QueryBlocks`, host-built) -> [T, N, value_dim]. Padding rows give values to ignore."""
  n = q.shape[1]
  nb, qlen = blocks.rows.shape
  q_blocks = q[blocks.rows]  # [QB, Q, N, C]

  def one_block(j, out):
    o = latent_multi_query_attention(
        q_blocks[j][None], kv, block_tables[blocks.chunk[j]][None], blocks.q_lens[j][None],
        scale=scale, value_dim=value_dim, block_tokens=block_tokens)
    return jax.lax.dynamic_update_index_in_dim(out, o[0], j, 0)

  out = jnp.zeros((nb, qlen, n, value_dim), q.dtype)
  out = jax.lax.fori_loop(0, blocks.count, one_block, out)
  return out.reshape(nb * qlen, n, value_dim)[blocks.unblock]


def latent_ragged_attention(q: jax.Array, kv: KVCache, block_tables: jax.Array,
                            cu_q_lens: jax.Array, kv_lens: jax.Array, *, scale: float,
                            value_dim: int, block_tokens: int = 128) -> jax.Array:
  """Prefill chunks' packed rows q [T, N, C] as one-query rows over their chunk's table
  (chunk c owns rows cu_q_lens[c]:cu_q_lens[c+1]; kv_lens: its keys after the chunk)
  -> [T, N, value_dim]; padding rows see no keys."""
  chunk, keys = packed_row_keys(cu_q_lens, kv_lens, q.shape[0], block_tables.shape[0])
  out = latent_multi_query_attention(q[:, None], kv, block_tables[chunk], keys[:, None],
                                     scale=scale, value_dim=value_dim,
                                     block_tokens=block_tokens)
  return out[:, 0]


def decode(backend: str, q: jax.Array, kv: KVCache, block_tables: jax.Array,
           seq_lens: jax.Array, *, scale: float, value_dim: int,
           block_tokens: int = 128) -> jax.Array:
  """Decode rows q [B, N, C] over their tables -> [B, N, value_dim]: the Pallas kernel on
  the Pallas backends where it applies (GPU or interpret mode, a float pool, power-of-two
  latent / rope / page sizes), the XLA loop otherwise."""
  from kernels_pallas import mla_decode
  kernel = (backend == "pallas_interpret"
            or (backend == "pallas" and jax.default_backend() != "tpu"))
  if (kernel and kv.dtype not in QUANTIZED_DTYPES
      and mla_decode.supports(q.shape, kv.k.shape, value_dim)):
    return mla_decode.mla_decode_attention(
        q, from_storage(kv.k, kv), block_tables, seq_lens, scale=scale, value_dim=value_dim,
        interpret=backend == "pallas_interpret")
  return latent_multi_query_attention(q[:, None], kv, block_tables, seq_lens[:, None],
                                      scale=scale, value_dim=value_dim,
                                      block_tokens=block_tokens)[:, 0]


def attend(backend: str, kind: str, meta: dict, layer, q: jax.Array, latent: jax.Array,
           kv: KVCache, *, scale: float, value_dim: int, block_tokens: int,
           window: tuple[jax.Array | int, int] | None = None) -> tuple[jax.Array, KVCache]:
  """The attention callback's latent path (steps.attend_fn): writes the rows latent
  [T, 1, C] at the layer's KV index, then attends q [T, N, C] as a `kind` step
  ("decode", "verify", "prefill") -> (weighted latents [T, N, value_dim], kv).
  `layer` counts this pool's layers; `window`: as attend_fn's (pipeline microbatches)."""
  index, tables = layer_pages(kv, layer, meta)
  kv = write_latent(kv, layer, latent, index)
  kw = dict(scale=scale, value_dim=value_dim, block_tokens=block_tokens)
  if kind == "decode":
    return decode(backend, q, kv, tables, meta["seq_lens"], **kw), kv
  if kind == "verify":  # q [B*T, N, C]
    q_lens = meta["q_lens"]
    out = latent_multi_query_attention(q.reshape(*q_lens.shape, *q.shape[1:]), kv, tables,
                                       q_lens, **kw)
    return out.reshape(*q.shape[:2], value_dim), kv
  whole = q
  if window is not None:
    start, total = window
    whole = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((total, *q.shape[1:]), q.dtype), q, start, axis=0)
  blocks = meta.get("blocks")
  if backend == "xla" and blocks is not None:
    out = latent_block_prefill_attention(whole, kv, tables, blocks, **kw)
  else:
    out = latent_ragged_attention(whole, kv, tables, meta["cu_q_lens"], meta["kv_lens"], **kw)
  if window is not None:
    out = jax.lax.dynamic_slice_in_dim(out, window[0], q.shape[0], axis=0)
  return out, kv
