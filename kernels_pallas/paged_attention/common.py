"""Small pieces shared by the paged-attention kernels (traced inside kernels).

The visible key range of a query row set is ``[first_key, last_key]`` where
``last_key`` is the newest query position and ``first_key`` is 0 or, with a
sliding window ``w``, ``oldest query position - w + 1``. Kernels only visit page
blocks that intersect it and clamp every block-table read to the sequence's
own pages, so entries past a sequence's last page are never touched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": keeps exp(NEG - m) == 0 without inf - inf NaNs.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_heads_per_block(num_kv_heads: int, head_dim: int, requested: int = 0) -> int:
  """KV heads per TPU block: ``requested``, or the smallest lane-aligned choice.

  TPU blocks must span a multiple of 128 lanes or the whole last dimension;
  pages are viewed as ``[P, page_size, K * H]`` so a block of d kv heads is a
  lane slice. With ``requested == 0`` this is the smallest divisor d of K with
  ``d * H % 128 == 0``, else K. ``requested == K`` makes every page copy one
  contiguous ``[page_size, K * H]`` DMA.
  """
  if requested:
    if num_kv_heads % requested or (requested * head_dim % 128 and requested != num_kv_heads):
      raise ValueError(f"kv_heads_per_block={requested} must divide {num_kv_heads=} and span "
                       f"a multiple of 128 lanes (head_dim={head_dim}) or all heads")
    return requested
  for d in range(1, num_kv_heads + 1):
    if num_kv_heads % d == 0 and (d * head_dim) % 128 == 0:
      return d
  return num_kv_heads


def first_visible_key(oldest_q_pos, sliding_window):
  """Position of the oldest key any query in the set may see."""
  if sliding_window is None:
    return jnp.zeros_like(oldest_q_pos)
  return jnp.maximum(oldest_q_pos - sliding_window + 1, 0)


def div(x, divisor: int):
  """``x // divisor`` for non-negative int32 ``x``.

  Truncating division equals floor division here and lowers to one op
  (floor division of signed ints needs a sign fix-up, which Mosaic lowers
  per TPU generation).
  """
  if isinstance(x, int):
    return x // divisor
  return jax.lax.div(x, jnp.asarray(divisor, x.dtype))


def num_pages(num_keys, page_size: int):
  """Pages holding ``num_keys`` keys (non-negative int32)."""
  return div(num_keys + page_size - 1, page_size)


def last_page(num_keys, page_size: int, pages_per_seq: int):
  """Index of the last block-table slot in use, clamped to ``[0, pages_per_seq - 1]``.

  The upper clamp keeps even an over-long length inside its own table row.
  """
  return jnp.clip(num_pages(num_keys, page_size) - 1, 0, pages_per_seq - 1)


def block_range(first_key, last_key, *, keys_per_block: int):
  """Inclusive page-block range [first, last] covering keys [first_key, last_key] (>= 0)."""
  return div(first_key, keys_per_block), div(last_key, keys_per_block)


def decode_block_range(seq_len, sliding_window, *, keys_per_block: int):
  """Visible page blocks [first, last] of a decode query at ``seq_len - 1``."""
  q_pos = jnp.maximum(seq_len - 1, 0)
  return block_range(first_visible_key(q_pos, sliding_window), q_pos,
                     keys_per_block=keys_per_block)


def cap_logits(logits, soft_cap):
  """``soft_cap * tanh(logits / soft_cap)``, or the logits unchanged."""
  if soft_cap is None:
    return logits
  return soft_cap * jnp.tanh(logits / soft_cap)


def key_mask(key_pos, q_pos, kv_len, sliding_window):
  """Broadcasting visibility of keys at ``key_pos`` to queries at ``q_pos``."""
  mask = (key_pos <= q_pos) & (key_pos < kv_len)
  if sliding_window is not None:
    mask &= key_pos > q_pos - sliding_window
  return mask
