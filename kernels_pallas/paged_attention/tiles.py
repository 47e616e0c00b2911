"""The query-tile schedule of the ragged kernels (computed on device, in jnp).

The flattened query rows ``[T]`` are cut into aligned blocks of ``q_block``
rows. A *tile* is one (query block, sequence) pair whose rows overlap; a block
shared by two sequences gives two tiles. Tiles are ordered by query block, so
on TPU all tiles of a block are consecutive grid steps and the output block
stays resident in VMEM while they fill it. Blocks holding only padding rows
get one padding tile (sequence id ``S``). The tile count is static:
``cdiv(T, q_block) + S`` bounds it; unused slots repeat the last block.

Row ownership: tile t writes the rows of its sequence inside its block, and
the first tile of each block also writes zeros to the block's padding rows
(those at or past ``cu_q_lens[S]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention import common


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tiles:
  """Per-tile arrays, each [num_tiles] int32."""

  seq: jax.Array  # sequence id, S for a padding tile
  q_block: jax.Array  # query block index
  first: jax.Array  # 1 if the tile is the first of its query block


def num_tiles(num_tokens: int, num_seqs: int, q_block: int) -> int:
  return -(-num_tokens // q_block) + num_seqs


def ragged_tiles(cu_q_lens, num_tokens: int, q_block: int) -> Tiles:
  """Tile schedule for ``cu_q_lens`` [S+1] over ``num_tokens`` rows."""
  num_seqs = cu_q_lens.shape[0] - 1
  num_blocks = -(-num_tokens // q_block)
  starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
  first_blk = starts // q_block
  last_blk = (ends - 1) // q_block
  count = jnp.where(ends > starts, last_blk - first_blk + 1, 0)
  cum = jnp.cumsum(count)
  total = cum[-1]
  t = jnp.arange(num_tiles(num_tokens, num_seqs, q_block), dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(cum, t, side="right"), num_seqs - 1).astype(jnp.int32)
  real_block = first_blk[seq] + t - (cum[seq] - count[seq])
  pad_block = jnp.minimum(-(-cu_q_lens[num_seqs] // q_block) + t - total, num_blocks - 1)
  is_real = t < total
  q_blk = jnp.where(is_real, real_block, pad_block).astype(jnp.int32)
  first = jnp.concatenate([jnp.ones((1,), jnp.bool_), q_blk[1:] != q_blk[:-1]])
  return Tiles(seq=jnp.where(is_real, seq, num_seqs).astype(jnp.int32), q_block=q_blk,
               first=first.astype(jnp.int32))


def tile_bounds(t, tile_seq, tile_qblock, cu_q_lens, kv_lens, *, q_block: int, num_seqs: int,
                keys_per_block: int, sliding_window):
  """Scalars of tile ``t`` (works on SMEM refs or arrays); ``sliding_window``: None,
  a static int, or a traced scalar (<= 0: none), see ``common``.

  Returns a dict: ``seq`` (clamped to a real id), ``valid`` (a real tile with
  rows), ``row0`` (first row of the block), ``lo``/``hi`` (the tile's own rows
  ``[lo, hi)``), ``q_shift`` (row r's query position is ``r + q_shift``),
  ``kv_len``, ``first_key`` (the oldest key any of its rows sees; keys before it may
  sit in pages released behind a window), ``first_blk``/``last_blk`` (the visible
  page blocks, inclusive).
  """
  raw = tile_seq[t]
  seq = jnp.minimum(raw, num_seqs - 1)
  row0 = tile_qblock[t] * q_block
  q_start, q_end = cu_q_lens[seq], cu_q_lens[seq + 1]
  lo = jnp.maximum(row0, q_start)
  hi = jnp.minimum(row0 + q_block, q_end)
  kv_len = kv_lens[seq]
  q_shift = kv_len - q_end  # q_pos(r) = r + q_shift
  valid = (raw < num_seqs) & (lo < hi)
  first_key = 0
  if sliding_window is not None:
    first_key = common.first_visible_key(lo + q_shift, sliding_window)
  last_key = jnp.maximum(hi - 1 + q_shift, 0)
  return dict(seq=seq, valid=valid, row0=row0, lo=lo, hi=hi, q_shift=q_shift, kv_len=kv_len,
              first_key=first_key, first_blk=common.div(first_key, keys_per_block),
              last_blk=common.div(last_key, keys_per_block))
