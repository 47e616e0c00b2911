"""Small pieces shared by the paged-attention kernels (traced inside kernels).

The visible key range of a query row set is ``[first_key, last_key]`` where
``last_key`` is the newest query position and ``first_key`` is 0 or, with a
sliding window ``w``, ``oldest query position - w + 1``. A window is static
(a Python int >= 1, or None) or traced: an int32 scalar the kernels receive as
a ``[1]`` operand (scalar prefetch on TPU, a small input on GPU), so a layer
stack scanned with ``lax.scan`` can give each layer its own; a traced window
``<= 0`` means none (full attention).

Attention sinks (GPT-OSS): per-head sink logits join each query row's softmax
denominator and contribute no value, so the online softmax starts from
``m = sink``, ``l = exp(sink - sink) = 1`` instead of ``m = NEG``, ``l = 0``
(``softmax_start``); a row that sees no key then gives zeros, as without
sinks. The soft cap applies to the q.k logits only, never to the sink. Kernels only visit page
blocks that intersect it and clamp every block-table read to the sequence's
own pages, so entries past a sequence's last page are never touched.

Quantized pages (``kv_quant`` "int8" | "fp8") are uint8 ``[..., H + 4]`` rows:
H one-byte codes (int8, or float8_e4m3fn bits) followed by the row's float32
scale as 4 little-endian bytes. ``load_rows`` reads one kv head's rows of a
page block and dequantizes them there (``codes * scale`` in float32), so no
kernel ever sees a dequantized pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Finite "minus infinity": keeps exp(NEG - m) == 0 without inf - inf NaNs.
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


# Code dtype of each quantized page layout; the float32 scale follows the codes.
CODE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SCALE_BYTES = 4


def row_width(head_dim: int, kv_quant: str | None) -> int:
  """Last dimension of a page row: H, or H codes + 4 scale bytes when quantized."""
  return head_dim + (SCALE_BYTES if kv_quant else 0)


def kv_heads_per_block(num_kv_heads: int, row_lanes: int, requested: int = 0) -> int:
  """KV heads per TPU block: ``requested``, or the smallest lane-aligned choice.

  TPU blocks must span a multiple of 128 lanes or the whole last dimension;
  pages are viewed as ``[P, page_size, K * R]`` (R = ``row_lanes``: H, or
  H + 4 for quantized pages) so a block of d kv heads is a lane slice. With
  ``requested == 0`` this is the smallest divisor d of K with
  ``d * R % 128 == 0``, else K (so quantized pages, R = 68 or 132, nearly
  always take whole pages). ``requested == K`` makes every page copy one
  contiguous ``[page_size, K * R]`` DMA.
  """
  if requested:
    if num_kv_heads % requested or (requested * row_lanes % 128 and requested != num_kv_heads):
      raise ValueError(f"kv_heads_per_block={requested} must divide {num_kv_heads=} and span "
                       f"a multiple of 128 lanes ({row_lanes} lanes per kv head) or all heads")
    return requested
  for d in range(1, num_kv_heads + 1):
    if num_kv_heads % d == 0 and (d * row_lanes) % 128 == 0:
      return d
  return num_kv_heads


def dequantize(codes, scale_bytes, kv_quant: str):
  """uint8 ``codes [..., H]`` times their row scales -> float32 ``[..., H]``.

  ``scale_bytes``: the 4 little-endian bytes of each row's float32 scale, each
  uint8 ``[..., 1]``. They are assembled into a uint32 and bitcast (same
  width: lowers on Mosaic, Triton and XLA alike); codes are bitcast to
  int8 / float8_e4m3fn (same width) and converted.
  """
  b = [x.astype(jnp.uint32) for x in scale_bytes]
  bits = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)
  scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
  values = jax.lax.bitcast_convert_type(codes, CODE_DTYPES[kv_quant]).astype(jnp.float32)
  return values * scale


def load_rows(ref, lead: tuple, start: int, head_dim: int, kv_quant: str | None):
  """``ref[*lead, start:start + head_dim]``: one kv head's keys or values of a block.

  With ``kv_quant`` the row's codes sit at ``start`` and its scale bytes at
  ``start + head_dim``; only those ``head_dim + 4`` bytes per row are read and
  dequantized to float32 here.
  """
  rows = ref[(*lead, pl.ds(start, head_dim))]
  if kv_quant is None:
    return rows
  scale_bytes = [ref[(*lead, pl.ds(start + head_dim + i, 1))] for i in range(SCALE_BYTES)]
  return dequantize(rows, scale_bytes, kv_quant)


def split_window(sliding_window):
  """A caller's window -> (static int | None, traced array | None).

  A Python (or numpy) int is static; anything else (a jax scalar, traced
  inside a scanned layer stack) is the traced window, which the kernels take
  as a ``[1]`` int32 operand.
  """
  if sliding_window is None or isinstance(sliding_window, (int, np.integer)):
    return (None if sliding_window is None else int(sliding_window)), None
  return None, jnp.asarray(sliding_window)


def window_value(sliding_window, window_ref):
  """The window a kernel applies: the static one, or the traced scalar in ``window_ref``."""
  return sliding_window if window_ref is None else window_ref[0]


def first_visible_key(oldest_q_pos, sliding_window):
  """Position of the oldest key any query in the set may see."""
  if sliding_window is None:
    return jnp.zeros_like(oldest_q_pos)
  first = jnp.maximum(oldest_q_pos - sliding_window + 1, 0)
  if isinstance(sliding_window, int):
    return first
  return jnp.where(sliding_window > 0, first, 0)


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
    inside = key_pos > q_pos - sliding_window
    if not isinstance(sliding_window, int):
      inside |= sliding_window <= 0
    mask &= inside
  return mask


def softmax_start(shape, sinks):
  """Initial (m, l) of an online softmax over rows ``shape``: (NEG, 0), or with the rows'
  sink logits ``sinks`` (float32, broadcastable to ``shape``) (sink, 1)."""
  if sinks is None:
    return jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32)
  return jnp.broadcast_to(sinks, shape).astype(jnp.float32), jnp.ones(shape, jnp.float32)
