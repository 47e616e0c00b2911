"""Paged decode attention on GPU (Pallas, Triton lowering).

One program per (sequence, kv head): it loads the sequence's G query heads as
one ``[Gp, H]`` tile (G padded to a power of two >= 16 for the tensor-core
dot), then loops over page blocks of the visible key range only, gathering
``pages_per_block`` pages by id from the pool (``k_pages_ref[ids]``) and
running an online softmax in registers. Page ids past the sequence's last
page are replaced by that last page before the gather, so garbage
block-table entries are never dereferenced; keys past the length are masked
(logits and values), so stale data in a partly filled page cannot leak.

Triton needs power-of-two tensor sizes: the block table is padded to a
multiple of ``pages_per_block`` (itself a power of two), and ``page_size`` and
``head_dim`` must be powers of two.
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
  k_ref,  # [P, page_size, H] (one kv head, strided view of the pool)
  v_ref,  # [P, page_size, H]
  tables_ref,  # [Wp] int32, this sequence's block table
  lens_ref,  # [B] int32
  # Outputs.
  o_ref,  # [Gp, H]
  *,
  pages_per_block: int,
  scale: float,
  sliding_window: int | None,
  soft_cap: float | None,
):
  b = pl.program_id(0)
  group_pad, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  seq_len = lens_ref[b]
  q_pos = seq_len - 1
  last_page = jnp.maximum(common.num_pages(seq_len, page_size) - 1, 0)
  first_blk, last_blk = common.decode_block_range(seq_len, sliding_window,
                                                  keys_per_block=block_k)
  q = q_ref[...]

  def body(blk, carry):
    m_prev, l_prev, acc = carry
    slots = jnp.minimum(blk * pages_per_block + jnp.arange(pages_per_block), last_page)
    ids = tables_ref[slots]  # [ppb], the sequence's own pages only
    # [ppb, page_size, H] -> [block_k, H]
    k = k_ref[ids].reshape(block_k, head_dim)
    v = v_ref[ids].reshape(block_k, head_dim)
    key_pos = blk * block_k + jnp.arange(block_k)
    mask = common.key_mask(key_pos, q_pos, seq_len, sliding_window)  # [block_k]
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

  init = (
    jnp.full((group_pad,), common.NEG, jnp.float32),
    jnp.zeros((group_pad,), jnp.float32),
    jnp.zeros((group_pad, head_dim), jnp.float32),
  )
  stop = jnp.where(seq_len > 0, last_blk + 1, first_blk)
  _, l, acc = jax.lax.fori_loop(first_blk, stop, body, init)
  l = l[:, None]
  o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def check_pow2(name, value):
  if value & (value - 1):
    raise ValueError(f"the GPU (Triton) kernels need a power-of-two {name}, got {value}")


def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                           sliding_window=None, soft_cap=None, interpret=False,
                           block_sizes: tuning.BlockSizes | None = None):
  """GPU paged decode attention; contract of ``kernels_pallas.paged_decode_attention``.

  q [B, N, H] f32|bf16; k_pages, v_pages [P, page_size, K, H] f32|bf16 (page_size
  and H powers of two); block_tables [B, W] int32; seq_lens [B] int32 ->
  [B, N, H] in q's dtype.
  """
  batch, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, _ = k_pages.shape
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
  q4 = q.reshape(batch, num_kv_heads, group, head_dim).astype(k_pages.dtype)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))

  q_spec = pl.BlockSpec((None, None, group_pad, head_dim), lambda b, h: (b, h, 0, 0))
  page_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h: (0, 0, h, 0))
  kernel = functools.partial(_decode_kernel, pages_per_block=ppb, scale=scale,
                             sliding_window=sliding_window, soft_cap=soft_cap)
  out = pl.pallas_call(
    kernel,
    grid=(batch, num_kv_heads),
    in_specs=[
      q_spec,
      page_spec,
      page_spec,
      pl.BlockSpec((None, padded_width), lambda b, h: (b, 0)),
      pl.BlockSpec((batch,), lambda b, h: (0,)),
    ],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps,
                                         num_stages=sizes.num_stages),
    interpret=interpret,
  )(q4, k_pages, v_pages, tables, seq_lens)
  # [B, K, Gp, H] -> [B, N, H]
  return out[:, :, :group].reshape(batch, num_q_heads, head_dim)
