"""Ragged paged attention on GPU (Pallas, Triton lowering).

One program per (tile, kv head); tiles come from ``tiles.ragged_tiles`` (an
aligned block of ``q_block`` query rows crossed with one sequence). The
program loads the block's rows for all G query heads of its kv head as one
``[q_block * Gp, H]`` tile (G padded to a power of two), loops over the
sequence's visible page blocks only (causal and sliding-window bounds of the
tile's own rows), gathering pages by id, and runs an online softmax in
registers. It stores only the rows it owns (masked store); the first tile of
each block also zeroes the block's padding rows. Page ids are clamped to the
sequence's own pages, keys past ``kv_len`` are masked in logits and values.
Quantized pages (``kv_quant``) are dequantized per gathered block as in
``decode_gpu``. A traced sliding window (``window``: int32 ``[1]``) is one
more whole input; sinks (``[N]`` f32) a ``[K, Gp]`` input that seeds ``m`` (the
sink) and ``l`` (1) of each stacked row. Neither adds an operand when absent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import common, tiles, tuning
from kernels_pallas.paged_attention.decode_gpu import check_pow2


def _ragged_kernel(
  # Inputs.
  q_ref,  # [T_pad, Gp, H] (one kv head)
  k_ref,  # [P, page_size, R] (one kv head, strided view of the pool; R = H or H + 4)
  v_ref,  # [P, page_size, R]
  tables_ref,  # [S, Wp] int32
  cu_ref,  # [S + 1] int32
  kv_lens_ref,  # [S] int32
  tile_seq_ref,  # [num_tiles] int32
  tile_qblock_ref,  # [num_tiles] int32
  tile_first_ref,  # [num_tiles] int32
  # Then window_ref [1] int32 (traced window only), sinks_ref [Gp] f32 (with sinks only);
  # the output o_ref [T_pad, Gp, H].
  *refs,
  q_block: int,
  pages_per_block: int,
  scale: float,
  sliding_window: int | None,
  traced_window: bool,
  has_sinks: bool,
  soft_cap: float | None,
  kv_quant: str | None,
):
  refs = list(refs)
  window_ref = refs.pop(0) if traced_window else None
  sinks_ref = refs.pop(0) if has_sinks else None
  (o_ref,) = refs
  window = common.window_value(sliding_window, window_ref)
  t = pl.program_id(0)
  _, group_pad, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  num_seqs = kv_lens_ref.shape[0]
  block_k = pages_per_block * page_size
  rows_n = q_block * group_pad
  bd = tiles.tile_bounds(t, tile_seq_ref, tile_qblock_ref, cu_ref, kv_lens_ref, q_block=q_block,
                         num_seqs=num_seqs, keys_per_block=block_k, sliding_window=window)
  kv_len = bd["kv_len"]
  last_page = common.last_page(kv_len, page_size, tables_ref.shape[1])
  rows = bd["row0"] + jnp.arange(q_block)
  row_in = bd["valid"] & (rows >= bd["lo"]) & (rows < bd["hi"])  # [bq]
  # [bq] -> [bq * Gp]: each token's position repeated for its Gp query heads
  q_pos = jnp.broadcast_to((rows + bd["q_shift"])[:, None], (q_block, group_pad)).reshape(rows_n)
  row_ok = jnp.broadcast_to(row_in[:, None], (q_block, group_pad)).reshape(rows_n)
  # [bq, Gp, H] -> [bq * Gp, H]
  q = q_ref[pl.ds(bd["row0"], q_block)].reshape(rows_n, head_dim)

  def body(blk, carry):
    m_prev, l_prev, acc = carry
    slots = jnp.minimum(blk * pages_per_block + jnp.arange(pages_per_block), last_page)
    ids = tables_ref[bd["seq"], slots]  # [ppb], the sequence's own pages only
    # [ppb, page_size, H] -> [block_k, H]
    k = common.load_rows(k_ref, (ids, slice(None)), 0, head_dim, kv_quant)
    v = common.load_rows(v_ref, (ids, slice(None)), 0, head_dim, kv_quant)
    k, v = k.reshape(block_k, head_dim), v.reshape(block_k, head_dim)
    key_pos = blk * block_k + jnp.arange(block_k)
    mask = common.key_mask(key_pos[None, :], q_pos[:, None], kv_len, window)
    mask &= row_ok[:, None]  # [rows_n, block_k]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(mask, common.cap_logits(s * scale, soft_cap), common.NEG)
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    v_ok = key_pos < kv_len
    if window is not None:  # pages behind the window may be released: anything (NaN)
      v_ok &= key_pos >= bd["first_key"]
    v = jnp.where(v_ok[:, None], v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc + pv

  sinks = None
  if sinks_ref is not None:  # [Gp] -> [bq * Gp], the stacked rows' heads
    sinks = jnp.broadcast_to(sinks_ref[...][None, :], (q_block, group_pad)).reshape(rows_n)
  m, l = common.softmax_start((rows_n,), sinks)
  init = (m, l, jnp.zeros((rows_n, head_dim), jnp.float32))
  stop = jnp.where(bd["valid"] & (kv_len > 0), bd["last_blk"] + 1, bd["first_blk"])
  _, l, acc = jax.lax.fori_loop(bd["first_blk"], stop, body, init)
  l = l[:, None]
  out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
  # Own rows get the result; the block's first tile zeroes its padding rows.
  pad_rows = (tile_first_ref[t] == 1) & (rows >= cu_ref[num_seqs])
  out = jnp.where(row_in[:, None, None], out.reshape(q_block, group_pad, head_dim), 0.0)
  store = jnp.broadcast_to((row_in | pad_rows)[:, None, None], out.shape)
  plgpu.store(o_ref.at[pl.ds(bd["row0"], q_block)], out.astype(o_ref.dtype), mask=store)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *, scale,
                           sliding_window=None, soft_cap=None, interpret=False,
                           block_sizes: tuning.BlockSizes | None = None, kv_quant=None,
                           window=None, sinks=None):
  """GPU ragged paged attention; contract of ``kernels_pallas.ragged_paged_attention``.

  q [T, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16
  (page_size and H powers of two; uint8 [..., H + 4] with ``kv_quant``);
  block_tables [S, W] int32; cu_q_lens [S+1] int32; kv_lens [S] int32; window
  None or int32 [1] (a traced window, replacing the static ``sliding_window``);
  sinks None or [N] f32 -> [T, N, H] in q's dtype. ``block_sizes.q_block``
  counts stacked rows (tokens * padded G), a power of two.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, row = k_pages.shape
  check_pow2("page_size", page_size)
  check_pow2("head_dim", head_dim)
  group = num_q_heads // num_kv_heads
  group_pad = pl.next_power_of_2(group)
  num_seqs, pages_per_seq = block_tables.shape
  sizes = block_sizes or tuning.lookup("gpu", "ragged", page_size, pages_per_seq)
  ppb = sizes.pages_per_block
  check_pow2("pages_per_block", ppb)
  check_pow2("q_block", sizes.q_block)
  # Tokens per tile: q_block rows shared by Gp heads, at least 16 rows for the dot.
  q_block = max(sizes.q_block // group_pad, 16 // group_pad, 1)
  num_q_blocks = pl.cdiv(num_tokens, q_block)
  padded_width = pl.cdiv(pages_per_seq, ppb) * ppb
  tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - pages_per_seq)))
  schedule = tiles.ragged_tiles(cu_q_lens, num_tokens, q_block)
  # [T, N, H] -> [T_pad, K, Gp, H]
  compute_dtype = jnp.float32 if kv_quant else k_pages.dtype  # of the (dequantized) keys
  q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(compute_dtype)
  q4 = jnp.pad(q4, ((0, num_q_blocks * q_block - num_tokens), (0, 0), (0, group_pad - group),
                    (0, 0)))

  def whole(x):
    return pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)

  q_spec = pl.BlockSpec((q4.shape[0], None, group_pad, head_dim), lambda t, h: (0, h, 0, 0))
  page_spec = pl.BlockSpec((num_pages, page_size, None, row), lambda t, h: (0, 0, h, 0))
  small = [tables, cu_q_lens, kv_lens, schedule.seq, schedule.q_block, schedule.first]
  small += [] if window is None else [window]
  inputs = [q4, k_pages, v_pages, *small]
  in_specs = [q_spec, page_spec, page_spec, *(whole(x) for x in small)]
  if sinks is not None:  # [N] -> [K, Gp]
    inputs.append(jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group))))
    in_specs.append(pl.BlockSpec((None, group_pad), lambda t, h: (h, 0)))
  kernel = functools.partial(_ragged_kernel, q_block=q_block, pages_per_block=ppb, scale=scale,
                             sliding_window=sliding_window, traced_window=window is not None,
                             has_sinks=sinks is not None, soft_cap=soft_cap, kv_quant=kv_quant)
  out = pl.pallas_call(
    kernel,
    grid=(schedule.seq.shape[0], num_kv_heads),
    in_specs=in_specs,
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps,
                                         num_stages=sizes.num_stages),
    interpret=interpret,
  )(*inputs)
  # [T_pad, K, Gp, H] -> [T, N, H]
  return out[:num_tokens, :, :group].reshape(num_tokens, num_q_heads, head_dim)
