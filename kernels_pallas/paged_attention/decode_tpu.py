"""Paged decode attention on TPU (Pallas Mosaic TPU).

Grid ``(batch, kv-head blocks, page blocks)``; the last axis is the online
softmax reduction. Block tables and lengths are scalar-prefetched into SMEM
and drive the K/V BlockSpec index maps, so each step DMAs exactly
``pages_per_block`` of the sequence's own pages into VMEM (one input per page
slot, all views of the same pool). Page blocks outside the visible range map
to the nearest visible block (the pipeline then skips the copy, since the
block index does not change) and skip their compute. All G query heads of a
kv head share each K/V tile: q is viewed as ``[B, K, G, H]``.

Pages are viewed as ``[P, page_size, K * H]`` (a free reshape) so a block of
``hb`` kv heads is a lane slice of ``hb * H`` lanes (a multiple of 128, or all
heads); see ``common.kv_heads_per_block``. Quantized pages (``kv_quant``) are
uint8 rows of R = H + 4 lanes (codes, then the float32 scale's bytes): the
view is ``[P, page_size, K * R]``, a block copies ``hb * R`` bytes per key
(hb = K unless ``hb * R`` is a multiple of 128), and each head's
``[page_size, H]`` tile is dequantized in VMEM (``common.load_rows``).

A traced sliding window (``window``: int32 ``[1]``) is a third scalar-prefetch
operand, read by the index maps and the body alike; sinks (``[N]`` f32) are a
``[K, G, 1]`` VMEM input whose block seeds the softmax statistics ``m`` (the
sink) and ``l`` (1) at the first page block. Neither adds an operand when absent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.paged_attention import common, tuning


def _decode_kernel(
  # Scalar prefetch (SMEM).
  tables_ref,  # [B * W] int32, flattened block tables
  lens_ref,  # [B] int32
  *refs,  # window_ref [1] int32 (traced window only); then the inputs (VMEM blocks):
  # q_ref [hb, G, H]; ppb K page blocks [page_size, hb * R], ppb V page blocks;
  # sinks_ref [hb, G, 1] f32 (with sinks only); then outputs and scratch:
  # o_ref [hb, G, H]; m_ref, l_ref [hb, G, 1] f32; acc_ref [hb, G, H] f32
  pages_per_block: int,
  scale: float,
  sliding_window: int | None,
  traced_window: bool,
  has_sinks: bool,
  soft_cap: float | None,
  kv_quant: str | None,
):
  del tables_ref
  refs = list(refs)
  window_ref = refs.pop(0) if traced_window else None
  q_ref = refs.pop(0)
  k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block : 2 * pages_per_block]
  refs = refs[2 * pages_per_block :]
  sinks_ref = refs.pop(0) if has_sinks else None
  o_ref, m_ref, l_ref, acc_ref = refs
  window = common.window_value(sliding_window, window_ref)
  b, blk, num_blocks = pl.program_id(0), pl.program_id(2), pl.num_programs(2)
  heads, _, head_dim = q_ref.shape
  row = common.row_width(head_dim, kv_quant)  # lanes per kv head in a page block
  page_size = k_refs[0].shape[0]
  keys_per_block = pages_per_block * page_size
  seq_len = lens_ref[b]
  q_pos = seq_len - 1
  first_blk, last_blk = common.decode_block_range(seq_len, window,
                                                  keys_per_block=keys_per_block)

  @pl.when(blk == 0)
  def _init():
    m, l = common.softmax_start(m_ref.shape, None if sinks_ref is None else sinks_ref[...])
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when((seq_len > 0) & (blk >= first_blk) & (blk <= last_blk))
  def _compute():
    for h in range(heads):
      q = q_ref[h]  # [G, H]
      logits, masks, values = [], [], []
      for j in range(pages_per_block):
        base = blk * keys_per_block + j * page_size
        k = common.load_rows(k_refs[j], (slice(None),), h * row, head_dim, kv_quant)  # [ps, H]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
        s = common.cap_logits(s, soft_cap)  # [G, page_size]
        key_pos = base + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        mask = common.key_mask(key_pos, q_pos, seq_len, window)
        logits.append(jnp.where(mask, s, common.NEG))
        masks.append(mask)
        row_pos = base + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        row_ok = common.key_mask(row_pos, q_pos, seq_len, window)
        v = common.load_rows(v_refs[j], (slice(None),), h * row, head_dim, kv_quant)
        values.append(jnp.where(row_ok, v, 0))  # [page_size, H]
      m_prev = m_ref[h]  # [G, 1]
      m_blk = functools.reduce(jnp.maximum, [s.max(axis=1, keepdims=True) for s in logits])
      m_new = jnp.maximum(m_prev, m_blk)
      alpha = jnp.exp(m_prev - m_new)
      l_new = alpha * l_ref[h]
      acc = alpha * acc_ref[h]
      for s, mask, v in zip(logits, masks, values, strict=True):
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_new += p.sum(axis=1, keepdims=True)
        acc += jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
      m_ref[h] = m_new
      l_ref[h] = l_new
      acc_ref[h] = acc

  @pl.when(blk == num_blocks - 1)
  def _finish():
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _page_index_map(pages_per_block, page_size, pages_per_seq, sliding_window, slot):
  """Index map of page slot ``slot``: (b, h, blk, tables, lens[, window]) -> page block
  index (a traced window is the third scalar-prefetch operand)."""
  keys_per_block = pages_per_block * page_size

  def index_map(b, h, blk, tables_ref, lens_ref, *window_ref):
    window = common.window_value(sliding_window, window_ref[0] if window_ref else None)
    seq_len = lens_ref[b]
    first_blk, last_blk = common.decode_block_range(seq_len, window,
                                                    keys_per_block=keys_per_block)
    blk = jnp.clip(blk, first_blk, jnp.maximum(last_blk, first_blk))
    last_page = common.last_page(seq_len, page_size, pages_per_seq)
    page = jnp.minimum(blk * pages_per_block + slot, last_page)
    page_id = jnp.where(seq_len > 0, tables_ref[b * pages_per_seq + page], 0)
    return page_id, 0, h

  return index_map


def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                           sliding_window=None, soft_cap=None, interpret=False,
                           block_sizes: tuning.BlockSizes | None = None, kv_quant=None,
                           window=None, sinks=None):
  """TPU paged decode attention; contract of ``kernels_pallas.paged_decode_attention``.

  q [B, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16 (uint8
  [P, page_size, K, H + 4] with ``kv_quant``); block_tables [B, W] int32;
  seq_lens [B] int32; window None or int32 [1] (a traced window, replacing the
  static ``sliding_window``); sinks None or [N] f32 -> [B, N, H] in q's dtype.
  """
  batch, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, row = k_pages.shape
  group = num_q_heads // num_kv_heads
  pages_per_seq = block_tables.shape[1]
  sizes = block_sizes or tuning.lookup("tpu", "decode", page_size, pages_per_seq)
  ppb = min(sizes.pages_per_block, pages_per_seq)
  num_blocks = pl.cdiv(pages_per_seq, ppb)
  hb = common.kv_heads_per_block(num_kv_heads, row, sizes.kv_heads_per_block)

  # [P, page_size, K, R] -> [P, page_size, K * R] (R = H, or H + 4 when quantized)
  k_flat = k_pages.reshape(num_pages, page_size, num_kv_heads * row)
  v_flat = v_pages.reshape(num_pages, page_size, num_kv_heads * row)
  # [B, N, H] -> [B, K, G, H], in the dtype of the (dequantized) keys
  compute_dtype = jnp.float32 if kv_quant else k_pages.dtype
  q4 = q.reshape(batch, num_kv_heads, group, head_dim).astype(compute_dtype)

  page_specs = [
    pl.BlockSpec((None, page_size, hb * row),
                 _page_index_map(ppb, page_size, pages_per_seq, sliding_window, j))
    for j in range(ppb)
  ]
  q_spec = pl.BlockSpec((None, hb, group, head_dim), lambda b, h, blk, *_: (b, h, 0, 0))
  prefetch = [block_tables.reshape(-1), seq_lens] + ([] if window is None else [window])
  inputs, in_specs = [q4, *([k_flat] * ppb), *([v_flat] * ppb)], [q_spec, *page_specs,
                                                                   *page_specs]
  if sinks is not None:  # [N] -> [K, G, 1]
    inputs.append(sinks.reshape(num_kv_heads, group, 1))
    in_specs.append(pl.BlockSpec((hb, group, 1), lambda b, h, blk, *_: (h, 0, 0)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(batch, num_kv_heads // hb, num_blocks),
    in_specs=in_specs,
    out_specs=q_spec,
    scratch_shapes=[
      pltpu.VMEM((hb, group, 1), jnp.float32),
      pltpu.VMEM((hb, group, 1), jnp.float32),
      pltpu.VMEM((hb, group, head_dim), jnp.float32),
    ],
  )
  kernel = functools.partial(_decode_kernel, pages_per_block=ppb, scale=scale,
                             sliding_window=sliding_window, traced_window=window is not None,
                             has_sinks=sinks is not None, soft_cap=soft_cap, kv_quant=kv_quant)
  out = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
  )(*prefetch, *inputs)
  # [B, K, G, H] -> [B, N, H]
  return out.reshape(batch, num_q_heads, head_dim)
