"""Ragged paged attention on TPU (Pallas Mosaic TPU).

Grid ``(kv-head blocks, tiles, page blocks)``. A tile is one (aligned query
block, sequence) pair from ``tiles.ragged_tiles``; the last axis is the online
softmax over the tile's visible page blocks. Block tables, ``cu_q_lens``,
``kv_lens`` and the tile schedule are scalar-prefetched into SMEM and drive
every index map: the q/out block of step ``(h, t, kv)`` is
``(tile_qblock[t], h)`` and page slot ``j`` reads the sequence's own page
``kv * pages_per_block + j`` (clamped into the visible range, so skipped steps
repeat the previous block index and the pipeline issues no copy).

q and out are viewed as ``[T, N * H]`` (a free reshape), pages as
``[P, page_size, K * H]``; a block holds ``hb`` kv heads and their ``hb * G``
query heads as lane slices. All G query heads of a kv head reuse each K/V
tile. Quantized pages (``kv_quant``) are uint8 rows of R = H + 4 lanes, viewed
``[P, page_size, K * R]``; each kv head's ``[page_size, H]`` tile is
dequantized in VMEM once per step and shared by its G query heads.
Consecutive tiles of one query block keep the output block resident: the
first zeroes it, each merges its own rows with a row mask.

A traced sliding window (``window``: int32 ``[1]``) is a seventh scalar-prefetch
operand (index maps and body read it); sinks (``[N]`` f32) are a
``[K / hb, hb * G, 1, 1]`` VMEM input that seeds ``m`` (the sink) and ``l`` (1)
of every row at a tile's first page block. Neither adds an operand when absent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.paged_attention import common, tiles, tuning


def _ragged_kernel(
  # Scalar prefetch (SMEM).
  tables_ref,  # [S * W] int32, flattened block tables
  cu_ref,  # [S + 1] int32
  kv_lens_ref,  # [S] int32
  tile_seq_ref,  # [num_tiles] int32
  tile_qblock_ref,  # [num_tiles] int32
  tile_first_ref,  # [num_tiles] int32
  *refs,  # window_ref [1] int32 (traced window only); then the inputs (VMEM blocks):
  # q_ref [bq, hb * G * H]; ppb K page blocks [page_size, hb * R], ppb V page blocks;
  # sinks_ref [hb * G, 1, 1] f32 (with sinks only); then outputs and scratch:
  # o_ref [bq, hb * G * H]; m_ref, l_ref [hb * G, bq, 1] f32; acc_ref [hb * G, bq, H] f32
  pages_per_block: int,
  group: int,
  num_seqs: int,
  scale: float,
  sliding_window: int | None,
  traced_window: bool,
  has_sinks: bool,
  soft_cap: float | None,
  kv_quant: str | None,
):
  del tables_ref
  ppb = pages_per_block
  refs = list(refs)
  window_ref = refs.pop(0) if traced_window else None
  q_ref = refs.pop(0)
  k_refs, v_refs = refs[:ppb], refs[ppb : 2 * ppb]
  refs = refs[2 * ppb :]
  sinks_ref = refs.pop(0) if has_sinks else None
  o_ref, m_ref, l_ref, acc_ref = refs
  window = common.window_value(sliding_window, window_ref)
  t, kv_blk, num_kv_blocks = pl.program_id(1), pl.program_id(2), pl.num_programs(2)
  q_block = q_ref.shape[0]
  page_size = k_refs[0].shape[0]
  head_dim = acc_ref.shape[-1]
  row = common.row_width(head_dim, kv_quant)  # lanes per kv head in a page block
  kv_heads = acc_ref.shape[0] // group
  keys_per_block = ppb * page_size
  bd = tiles.tile_bounds(t, tile_seq_ref, tile_qblock_ref, cu_ref, kv_lens_ref, q_block=q_block,
                         num_seqs=num_seqs, keys_per_block=keys_per_block,
                         sliding_window=window)
  rows = bd["row0"] + jax.lax.broadcasted_iota(jnp.int32, (q_block, 1), 0)
  row_in = (rows >= bd["lo"]) & (rows < bd["hi"])
  q_pos = rows + bd["q_shift"]  # [bq, 1]
  kv_len = bd["kv_len"]

  @pl.when(kv_blk == 0)
  def _init():
    m, l = common.softmax_start(m_ref.shape, None if sinks_ref is None else sinks_ref[...])
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(tile_first_ref[t] == 1)
    def _zero_block():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

  @pl.when(bd["valid"] & (kv_blk >= bd["first_blk"]) & (kv_blk <= bd["last_blk"]))
  def _compute():
    masks, v_ok = [], []
    for j in range(ppb):
      base = kv_blk * keys_per_block + j * page_size
      key_pos = base + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
      masks.append(common.key_mask(key_pos, q_pos, kv_len, window) & row_in)
      row_pos = base + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
      ok = row_pos < kv_len
      if window is not None:  # pages behind the window may be released: anything (NaN)
        ok &= row_pos >= bd["first_key"]
      v_ok.append(ok)
    for h in range(kv_heads):
      def load(ref, h=h):  # [page_size, H] of kv head h
        return common.load_rows(ref, (slice(None),), h * row, head_dim, kv_quant)

      keys = [load(k_refs[j]) for j in range(ppb)]
      values = [jnp.where(v_ok[j], load(v_refs[j]), 0) for j in range(ppb)]
      for g in range(group):
        idx = h * group + g
        q = q_ref[:, pl.ds(idx * head_dim, head_dim)]  # [bq, H]
        logits = []
        for k, mask in zip(keys, masks, strict=True):
          s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32) * scale
          logits.append(jnp.where(mask, common.cap_logits(s, soft_cap), common.NEG))
        m_prev = m_ref[idx]  # [bq, 1]
        m_blk = functools.reduce(jnp.maximum, [s.max(axis=1, keepdims=True) for s in logits])
        m_new = jnp.maximum(m_prev, m_blk)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_ref[idx]
        acc = alpha * acc_ref[idx]
        for s, mask, v in zip(logits, masks, values, strict=True):
          p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
          l_new += p.sum(axis=1, keepdims=True)
          acc += jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_ref[idx] = m_new
        l_ref[idx] = l_new
        acc_ref[idx] = acc

  @pl.when(bd["valid"] & (kv_blk == num_kv_blocks - 1))
  def _finish():
    for idx in range(kv_heads * group):
      lanes = pl.ds(idx * head_dim, head_dim)
      l = l_ref[idx]
      out = jnp.where(l > 0, acc_ref[idx] / jnp.where(l > 0, l, 1.0), 0.0)
      o_ref[:, lanes] = jnp.where(row_in, out.astype(o_ref.dtype), o_ref[:, lanes])


def _page_index_map(slot, *, pages_per_block, page_size, pages_per_seq, q_block, num_seqs,
                    sliding_window):
  """Index map of K/V page slot ``slot`` for grid step (h, t, kv); the scalar-prefetch
  refs follow (a traced window last)."""

  def index_map(h, t, kv_blk, tables_ref, cu_ref, kv_lens_ref, tile_seq_ref, tile_qblock_ref,
                tile_first_ref, *window_ref):
    del tile_first_ref
    window = common.window_value(sliding_window, window_ref[0] if window_ref else None)
    bd = tiles.tile_bounds(t, tile_seq_ref, tile_qblock_ref, cu_ref, kv_lens_ref,
                           q_block=q_block, num_seqs=num_seqs,
                           keys_per_block=pages_per_block * page_size,
                           sliding_window=window)
    kv_blk = jnp.clip(kv_blk, bd["first_blk"], jnp.maximum(bd["last_blk"], bd["first_blk"]))
    last_page = common.last_page(bd["kv_len"], page_size, pages_per_seq)
    page = jnp.minimum(kv_blk * pages_per_block + slot, last_page)
    use = bd["valid"] & (bd["kv_len"] > 0)
    return jnp.where(use, tables_ref[bd["seq"] * pages_per_seq + page], 0), 0, h

  return index_map


def _page_specs(pages_per_block, page_size, lanes, **index_kw):
  """One BlockSpec [page_size, lanes] per page slot of a block, all over the same pool."""
  return [
    pl.BlockSpec((None, page_size, lanes),
                 _page_index_map(j, pages_per_block=pages_per_block, page_size=page_size,
                                 **index_kw))
    for j in range(pages_per_block)
  ]


def ragged_paged_attention(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *, scale,
                           sliding_window=None, soft_cap=None, interpret=False,
                           block_sizes: tuning.BlockSizes | None = None, kv_quant=None,
                           window=None, sinks=None):
  """TPU ragged paged attention; contract of ``kernels_pallas.ragged_paged_attention``.

  q [T, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16 (uint8
  [..., H + 4] with ``kv_quant``); block_tables [S, W] int32; cu_q_lens [S+1]
  int32; kv_lens [S] int32; window None or int32 [1] (a traced window, replacing
  the static ``sliding_window``); sinks None or [N] f32 -> [T, N, H] in q's
  dtype. ``block_sizes.q_block`` must be a multiple of 8.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, row = k_pages.shape
  group = num_q_heads // num_kv_heads
  num_seqs, pages_per_seq = block_tables.shape
  sizes = block_sizes or tuning.lookup("tpu", "ragged", page_size, pages_per_seq)
  ppb = min(sizes.pages_per_block, pages_per_seq)
  q_block = sizes.q_block
  if q_block < 8 or q_block % 8:
    raise ValueError(f"TPU ragged attention needs q_block a multiple of 8, got {q_block}")
  num_q_blocks = pl.cdiv(num_tokens, q_block)
  hb = common.kv_heads_per_block(num_kv_heads, row, sizes.kv_heads_per_block)
  schedule = tiles.ragged_tiles(cu_q_lens, num_tokens, q_block)

  # [T, N, H] -> [T_pad, N * H]
  compute_dtype = jnp.float32 if kv_quant else k_pages.dtype  # of the (dequantized) keys
  q2 = q.reshape(num_tokens, num_q_heads * head_dim).astype(compute_dtype)
  q2 = jnp.pad(q2, ((0, num_q_blocks * q_block - num_tokens), (0, 0)))
  # [P, page_size, K, R] -> [P, page_size, K * R] (R = H, or H + 4 when quantized)
  k_flat = k_pages.reshape(num_pages, page_size, num_kv_heads * row)
  v_flat = v_pages.reshape(num_pages, page_size, num_kv_heads * row)

  page_specs = _page_specs(ppb, page_size, hb * row, pages_per_seq=pages_per_seq,
                          q_block=q_block, num_seqs=num_seqs, sliding_window=sliding_window)
  q_spec = pl.BlockSpec((q_block, hb * group * head_dim),
                        lambda h, t, kv, tab, cu, kvl, tseq, tqb, *_: (tqb[t], h))
  prefetch = [block_tables.reshape(-1), cu_q_lens, kv_lens, schedule.seq, schedule.q_block,
              schedule.first] + ([] if window is None else [window])
  inputs = [q2, *([k_flat] * ppb), *([v_flat] * ppb)]
  in_specs = [q_spec, *page_specs, *page_specs]
  if sinks is not None:  # [N] -> [K / hb, hb * G, 1, 1]
    inputs.append(sinks.reshape(num_kv_heads // hb, hb * group, 1, 1))
    in_specs.append(pl.BlockSpec((None, hb * group, 1, 1), lambda h, *_: (h, 0, 0, 0)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(num_kv_heads // hb, schedule.seq.shape[0], pl.cdiv(pages_per_seq, ppb)),
    in_specs=in_specs,
    out_specs=q_spec,
    scratch_shapes=[
      pltpu.VMEM((hb * group, q_block, 1), jnp.float32),
      pltpu.VMEM((hb * group, q_block, 1), jnp.float32),
      pltpu.VMEM((hb * group, q_block, head_dim), jnp.float32),
    ],
  )
  kernel = functools.partial(_ragged_kernel, pages_per_block=ppb, group=group,
                             num_seqs=num_seqs, scale=scale, sliding_window=sliding_window,
                             traced_window=window is not None, has_sinks=sinks is not None,
                             soft_cap=soft_cap, kv_quant=kv_quant)
  out = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q2.shape, q.dtype),
    # Tiles of one query block must run in order on one core (resident output).
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")),
    interpret=interpret,
  )(*prefetch, *inputs)
  # [T_pad, N * H] -> [T, N, H]
  return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
