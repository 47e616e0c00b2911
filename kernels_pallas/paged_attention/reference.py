"""Pure-jnp references for paged decode and ragged paged attention.

They gather each sequence's pages through its block table, mask by length,
causality and sliding window, and run softmax in float32. They are the
numerical ground truth for the Pallas kernels beside them and the XLA path
the engine uses on CPU. Page ids past a sequence's last page are replaced by
page 0 before the gather, so garbage block-table entries are never read.

Masking rule (shared with every kernel): a query at position ``i`` sees key
``j`` iff ``j <= i`` and, with a sliding window ``w``, ``i - j < w`` (a traced
window ``<= 0``: no window). Logits are ``scale * q.k``, then
``soft_cap * tanh(logits / soft_cap)`` when capped. With ``sinks`` (``[N]``,
GPT-OSS) head n's sink logit joins every row's softmax as one more column
whose probability is then dropped (it has no value).

Quantized pages (``kv_quant``) are dequantized after the gather, as the kernels
do per block (``common.dequantize``): only the gathered pages, never the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention import common

_HIGHEST = jax.lax.Precision.HIGHEST


def dequantize_pages(pages, kv_quant):
  """uint8 [..., H + 4] quantized rows -> float32 [..., H] (see ``common.dequantize``)."""
  head_dim = pages.shape[-1] - common.SCALE_BYTES
  scale_bytes = [pages[..., head_dim + i:head_dim + i + 1] for i in range(common.SCALE_BYTES)]
  return common.dequantize(pages[..., :head_dim], scale_bytes, kv_quant)


def _gather_pages(pages, block_tables, num_valid_pages, kv_quant):
  """[P, ps, K, H] pages (H + 4 bytes if quantized), [R, W] tables -> [R, W * ps, K, H]."""
  rows, width = block_tables.shape
  _, page_size, num_kv_heads, _ = pages.shape
  in_use = jnp.arange(width)[None, :] < num_valid_pages[:, None]
  safe_tables = jnp.where(in_use, block_tables, 0)
  gathered = pages[safe_tables]  # [R, W, ps, K, H or H + 4]
  if kv_quant is not None:
    gathered = dequantize_pages(gathered, kv_quant)
  # [R, W, ps, K, H] -> [R, W * ps, K, H]
  return gathered.reshape(rows, width * page_size, num_kv_heads, gathered.shape[-1])


def _attend(q, k, v, valid, scale, soft_cap, sinks=None):
  """Masked softmax attention of one query row per r.

  q [R, N, H]; k, v [R, L, K, H]; valid [R, L] bool; sinks None or [N] float32.
  Returns [R, N, H] in q's dtype; rows with no valid key are zeros.
  """
  rows, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_q_heads // num_kv_heads
  # [R, N, H] -> [R, K, G, H]
  qg = q.astype(jnp.float32).reshape(rows, num_kv_heads, group, head_dim)
  logits = jnp.einsum("rkgh,rlkh->rkgl", qg, k.astype(jnp.float32), precision=_HIGHEST) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  mask = valid[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:  # [N] -> [1, K, G, 1]
    sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
    row_max = jnp.maximum(row_max, sink)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  if sinks is not None:
    denom += jnp.exp(sink - row_max)
  v = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)
  out = jnp.einsum("rkgl,rlkh->rkgh", probs, v, precision=_HIGHEST)
  out = out / jnp.where(denom > 0, denom, 1.0)
  # [R, K, G, H] -> [R, N, H]
  return out.reshape(rows, num_q_heads, head_dim).astype(q.dtype)


def _key_mask(key_pos, q_pos, kv_len, sliding_window):
  """key_pos [L]; q_pos, kv_len [R] -> [R, L] visibility."""
  return common.key_mask(key_pos[None, :], q_pos[:, None], kv_len[:, None], sliding_window)


def ref_paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                               sliding_window=None, soft_cap=None, kv_quant=None, sinks=None):
  """Reference paged decode attention; same contract as ``paged_decode_attention``.

  q [B, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16 (uint8
  [..., H + 4] with ``kv_quant``); block_tables [B, W] int32; seq_lens [B]
  int32; sliding_window None, an int or a traced int32 scalar (<= 0: none);
  sinks None or [N] float32. Returns [B, N, H] in q's dtype.
  """
  page_size = k_pages.shape[1]
  num_valid_pages = (seq_lens + page_size - 1) // page_size
  k = _gather_pages(k_pages, block_tables, num_valid_pages, kv_quant)
  v = _gather_pages(v_pages, block_tables, num_valid_pages, kv_quant)
  key_pos = jnp.arange(k.shape[1])
  valid = _key_mask(key_pos, seq_lens - 1, seq_lens, sliding_window)
  return _attend(q, k, v, valid, scale, soft_cap, sinks)


def ragged_token_layout(cu_q_lens, kv_lens, num_tokens):
  """Per-token sequence id, query position and validity for ragged batches.

  cu_q_lens [S+1] int32, kv_lens [S] int32 -> (seq_id [T], q_pos [T], valid [T]).
  Tokens at or past ``cu_q_lens[S]`` are padding (``valid`` False).
  """
  num_seqs = kv_lens.shape[0]
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_id = jnp.searchsorted(cu_q_lens, tokens, side="right").astype(jnp.int32) - 1
  seq_id = jnp.clip(seq_id, 0, num_seqs - 1)
  q_start = cu_q_lens[seq_id]
  q_len = cu_q_lens[seq_id + 1] - q_start
  q_pos = kv_lens[seq_id] - q_len + (tokens - q_start)
  valid = (tokens >= cu_q_lens[0]) & (tokens < cu_q_lens[num_seqs])
  return seq_id, q_pos, valid


def ref_ragged_paged_attention(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *, scale,
                               sliding_window=None, soft_cap=None, kv_quant=None, sinks=None):
  """Reference ragged paged attention; same contract as ``ragged_paged_attention``.

  q [T, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] (uint8 [..., H + 4]
  with ``kv_quant``); block_tables [S, W] int32; cu_q_lens [S+1] int32; kv_lens
  [S] int32; sliding_window and sinks as in ``ref_paged_decode_attention``.
  Returns [T, N, H] in q's dtype.
  Materialises [T, W * page_size, K, H] keys: a reference, not a fast path.
  """
  page_size = k_pages.shape[1]
  seq_id, q_pos, token_ok = ragged_token_layout(cu_q_lens, kv_lens, q.shape[0])
  kv_len = jnp.where(token_ok, kv_lens[seq_id], 0)
  num_valid_pages = (kv_len + page_size - 1) // page_size
  tables = block_tables[seq_id]
  k = _gather_pages(k_pages, tables, num_valid_pages, kv_quant)
  v = _gather_pages(v_pages, tables, num_valid_pages, kv_quant)
  key_pos = jnp.arange(k.shape[1])
  valid = _key_mask(key_pos, q_pos, kv_len, sliding_window)
  return _attend(q, k, v, valid, scale, soft_cap, sinks)
