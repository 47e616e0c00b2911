"""Paged decode attention on GPU (Pallas, Triton lowering).

One program per (sequence, kv head, split): it loads the sequence's G query
heads as one ``[Gp, H]`` tile (G padded to a power of two >= 16 for the
tensor-core dot), then loops over its split's share of the visible page
blocks only, gathering ``pages_per_block`` pages by id from the pool
(``k_pages_ref[ids]``) and running an online softmax in registers. With one
split it writes the normalised output; with several (small batches: see
``num_splits_for``) each writes its f32 accumulator and softmax statistics
and a jnp epilogue combines them. Page ids past the sequence's last
page are replaced by that last page before the gather, so garbage
block-table entries are never dereferenced; keys past the length are masked
(logits and values), so stale data in a partly filled page cannot leak.

Triton needs power-of-two tensor sizes: the block table is padded to a
multiple of ``pages_per_block`` (itself a power of two), and ``page_size`` and
``head_dim`` must be powers of two. Quantized pages (``kv_quant``: uint8 rows
of H codes + 4 scale bytes) are gathered as ``[ppb, page_size, H]`` codes plus
four ``[ppb, page_size, 1]`` byte loads and dequantized in registers
(``common.load_rows``), so every loaded tensor keeps a power-of-two size.

A traced sliding window (``window``: int32 ``[1]``) is one more (whole) input;
sinks (``[N]`` f32) a ``[K, Gp]`` input whose row seeds ``m`` (the sink) and
``l`` (1) of the first split only, so the split epilogue counts each sink
once. Neither adds an operand when absent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import common, tuning


def _decode_kernel(
  # Inputs.
  q_ref,  # [Gp, H]
  k_ref,  # [P, page_size, R] (one kv head, strided view of the pool; R = H or H + 4)
  v_ref,  # [P, page_size, R]
  tables_ref,  # [Wp] int32, this sequence's block table
  lens_ref,  # [B] int32
  # Then window_ref [1] int32 (traced window only), sinks_ref [Gp] f32 (with sinks only);
  # outputs: o_ref [Gp, H]; with num_splits > 1 it holds the unnormalised f32
  # accumulator and m_ref, l_ref [Gp] f32 the split's softmax statistics.
  *refs,
  pages_per_block: int,
  num_splits: int,
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
  o_ref, *stat_refs = refs
  window = common.window_value(sliding_window, window_ref)
  b, split = pl.program_id(0), pl.program_id(2)
  group_pad, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  seq_len = lens_ref[b]
  q_pos = seq_len - 1
  last_page = common.last_page(seq_len, page_size, tables_ref.shape[0])
  first_blk, last_blk = common.decode_block_range(seq_len, window, keys_per_block=block_k)
  stop = jnp.where(seq_len > 0, last_blk + 1, first_blk)
  # This split's share of the visible blocks [first_blk, stop).
  per_split = common.div(stop - first_blk + num_splits - 1, num_splits)
  start = jnp.minimum(first_blk + split * per_split, stop)
  stop = jnp.minimum(start + per_split, stop)
  q = q_ref[...]

  def body(blk, carry):
    m_prev, l_prev, acc = carry
    slots = jnp.minimum(blk * pages_per_block + jnp.arange(pages_per_block), last_page)
    ids = tables_ref[slots]  # [ppb], the sequence's own pages only
    # [ppb, page_size, H] -> [block_k, H]
    k = common.load_rows(k_ref, (ids, slice(None)), 0, head_dim, kv_quant)
    v = common.load_rows(v_ref, (ids, slice(None)), 0, head_dim, kv_quant)
    k, v = k.reshape(block_k, head_dim), v.reshape(block_k, head_dim)
    key_pos = blk * block_k + jnp.arange(block_k)
    mask = common.key_mask(key_pos, q_pos, seq_len, window)  # [block_k]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = common.cap_logits(s * scale, soft_cap)  # [Gp, block_k]
    s = jnp.where(mask[None, :], s, common.NEG)
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    v = jnp.where(mask[:, None], v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc + pv

  sinks = None
  if sinks_ref is not None:  # the first split carries the sink; the others start empty
    sinks = jnp.where(split == 0, sinks_ref[...], common.NEG)
  m, l = common.softmax_start((group_pad,), sinks)
  if sinks_ref is not None:
    l = jnp.where(split == 0, l, 0.0)
  init = (m, l, jnp.zeros((group_pad, head_dim), jnp.float32))
  m, l, acc = jax.lax.fori_loop(start, stop, body, init)
  if num_splits > 1:
    m_ref, l_ref = stat_refs
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
  else:
    l = l[:, None]
    o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _combine_splits(acc, m, l):
  """acc [splits, ..., H], m, l [splits, ...] -> normalised [..., H] f32."""
  weight = jnp.exp(m - m.max(axis=0, keepdims=True))  # [splits, ...]
  total = (weight * l).sum(axis=0)[..., None]
  out = (weight[..., None] * acc).sum(axis=0)
  return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


def _outputs(q_shape, dtype, splits):
  """Out specs and shapes: the output [B, K, Gp, H], or per-split acc, m and l (f32)."""
  _, _, group_pad, head_dim = q_shape
  if splits == 1:
    spec = pl.BlockSpec((None, None, group_pad, head_dim), lambda b, h, s: (b, h, 0, 0))
    return spec, jax.ShapeDtypeStruct(q_shape, dtype)
  acc_spec = pl.BlockSpec((None, None, None, group_pad, head_dim),
                          lambda b, h, s: (s, b, h, 0, 0))
  stat_spec = pl.BlockSpec((None, None, None, group_pad), lambda b, h, s: (s, b, h, 0))
  acc_shape = jax.ShapeDtypeStruct((splits, *q_shape), jnp.float32)
  stat_shape = jax.ShapeDtypeStruct((splits, *q_shape[:3]), jnp.float32)
  return [acc_spec, stat_spec, stat_spec], [acc_shape, stat_shape, stat_shape]


def num_splits_for(batch: int, num_kv_heads: int, num_blocks: int, requested: int) -> int:
  """Key-range splits per (sequence, kv head): ``requested``, or enough programs to fill a GPU.

  ``requested == 0`` targets ~256 programs (about two per SM on an H100/H200).
  """
  if requested:
    return max(1, min(requested, num_blocks))
  return max(1, min(pl.cdiv(256, batch * num_kv_heads), num_blocks, 16))


def check_pow2(name, value):
  if value & (value - 1):
    raise ValueError(f"the GPU (Triton) kernels need a power-of-two {name}, got {value}")


def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                           sliding_window=None, soft_cap=None, interpret=False,
                           block_sizes: tuning.BlockSizes | None = None, kv_quant=None,
                           window=None, sinks=None):
  """GPU paged decode attention; contract of ``kernels_pallas.paged_decode_attention``.

  q [B, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16 (page_size
  and H powers of two; uint8 [..., H + 4] with ``kv_quant``); block_tables
  [B, W] int32; seq_lens [B] int32; window None or int32 [1] (a traced window,
  replacing the static ``sliding_window``); sinks None or [N] f32 -> [B, N, H]
  in q's dtype.
  """
  batch, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, row = k_pages.shape
  check_pow2("page_size", page_size)
  check_pow2("head_dim", head_dim)
  group = num_q_heads // num_kv_heads
  group_pad = max(16, pl.next_power_of_2(group))
  pages_per_seq = block_tables.shape[1]
  sizes = block_sizes or tuning.lookup("gpu", "decode", page_size, pages_per_seq)
  ppb = sizes.pages_per_block
  check_pow2("pages_per_block", ppb)
  padded_width = pl.cdiv(pages_per_seq, ppb) * ppb
  tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - pages_per_seq)))
  # [B, N, H] -> [B, K, Gp, H]
  compute_dtype = jnp.float32 if kv_quant else k_pages.dtype  # of the (dequantized) keys
  q4 = q.reshape(batch, num_kv_heads, group, head_dim).astype(compute_dtype)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))

  splits = num_splits_for(batch, num_kv_heads, padded_width // ppb, sizes.num_splits)

  q_spec = pl.BlockSpec((None, None, group_pad, head_dim), lambda b, h, s: (b, h, 0, 0))
  page_spec = pl.BlockSpec((num_pages, page_size, None, row),
                           lambda b, h, s: (0, 0, h, 0))
  inputs = [q4, k_pages, v_pages, tables, seq_lens]
  in_specs = [q_spec, page_spec, page_spec,
              pl.BlockSpec((None, padded_width), lambda b, h, s: (b, 0)),
              pl.BlockSpec((batch,), lambda b, h, s: (0,))]
  if window is not None:
    inputs.append(window)
    in_specs.append(pl.BlockSpec((1,), lambda b, h, s: (0,)))
  if sinks is not None:  # [N] -> [K, Gp]
    inputs.append(jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, group_pad - group))))
    in_specs.append(pl.BlockSpec((None, group_pad), lambda b, h, s: (h, 0)))
  out_specs, out_shape = _outputs(q4.shape, q.dtype, splits)
  kernel = functools.partial(_decode_kernel, pages_per_block=ppb, num_splits=splits,
                             scale=scale, sliding_window=sliding_window,
                             traced_window=window is not None, has_sinks=sinks is not None,
                             soft_cap=soft_cap, kv_quant=kv_quant)
  out = pl.pallas_call(
    kernel,
    grid=(batch, num_kv_heads, splits),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps,
                                         num_stages=sizes.num_stages),
    interpret=interpret,
  )(*inputs)
  if splits > 1:
    out = _combine_splits(*out).astype(q.dtype)
  # [B, K, Gp, H] -> [B, N, H]
  return out[:, :, :group].reshape(batch, num_q_heads, head_dim)
