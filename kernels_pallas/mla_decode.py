"""Paged decode attention over a latent KV cache (multi-head latent attention), Pallas.

The pool holds one row per token: the latent c [R] then the roped key k_pe [r]
(`pages` [P, page_size, 1, R + r], one "KV head"); absorbed queries are
[B, N, R + r] (serving/runner/mla_attention.py). A decode row's output is the
softmax-weighted latents [N, R]:

  s[n, j] = scale * (q[n, :R] . c_j + q[n, R:] . k_pe_j),  out[n] = sum_j p[n, j] c_j.

One program per (sequence, block of `HEADS_PER_BLOCK` heads): the heads' query
tile stays in registers while the program loops over the sequence's page blocks
up to its length, gathering `pages_per_block` pages by id (`pages_ref[ids]`),
reading the latent and the rope part as two power-of-two slices of each row
(Triton needs power-of-two tensors: R and r must be powers of two; the row
R + r need not be), with an online softmax. Every head reads the same rows,
so a block of keys is loaded once per head block, not once per head. Page
ids past the sequence's last page are replaced by that page (never a foreign
page), keys past the length are masked in the scores and the values.

`impl="gpu"` lowers through Triton; `interpret=True` runs the same kernel in
the Pallas interpreter (CPU tests). `ref_mla_decode_attention` is the pure-jnp
reference. There is no Mosaic TPU kernel: the engine's TPU path takes the XLA
loop (serving/runner/mla_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.paged_attention import common

HEADS_PER_BLOCK = 16  # query heads per program (the tensor-core tile's rows)
PAGES_PER_BLOCK = 8  # pages gathered per loop iteration (at most the table width)


def _kernel(q_ref, pages_ref, tables_ref, lens_ref, o_ref, *, latent: int, rope: int,
            pages_per_block: int, scale: float):
  b = pl.program_id(0)
  page_size = pages_ref.shape[1]
  block_k = pages_per_block * page_size
  seq_len = lens_ref[b]
  last_page = common.last_page(seq_len, page_size, tables_ref.shape[0])
  q_lat = q_ref[:, pl.ds(0, latent)]  # [Hb, R]
  q_pe = q_ref[:, pl.ds(latent, rope)]  # [Hb, r]
  dims = (((1,), (1,)), ((), ()))

  def body(blk, carry):
    m_prev, l_prev, acc = carry
    slots = jnp.minimum(blk * pages_per_block + jnp.arange(pages_per_block), last_page)
    ids = tables_ref[slots]
    c = pages_ref[ids, :, pl.ds(0, latent)].reshape(block_k, latent)
    k_pe = pages_ref[ids, :, pl.ds(latent, rope)].reshape(block_k, rope)
    s = (jax.lax.dot_general(q_lat, c, dims, preferred_element_type=jnp.float32)
         + jax.lax.dot_general(q_pe, k_pe, dims, preferred_element_type=jnp.float32)) * scale
    mask = blk * block_k + jnp.arange(block_k) < seq_len  # [block_k]
    s = jnp.where(mask[None, :], s, common.NEG)
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    c = jnp.where(mask[:, None], c, jnp.zeros_like(c))
    pv = jax.lax.dot_general(p.astype(c.dtype), c, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc + pv

  heads = q_ref.shape[0]
  m, l = common.softmax_start((heads,), None)
  init = (m, l, jnp.zeros((heads, latent), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, common.div(seq_len + block_k - 1, block_k), body, init)
  l = l[:, None]
  o_ref[...] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def supports(q_shape: tuple[int, ...], pages_shape: tuple[int, ...], value_dim: int) -> bool:
  """Whether `mla_decode_attention` takes these shapes (powers of two where it needs them);
  callers fall back to their XLA path otherwise."""
  rope, page_size = q_shape[-1] - value_dim, pages_shape[1]
  return all(v > 0 and not v & (v - 1) for v in (value_dim, rope, page_size))


def _check_pow2(name: str, value: int) -> None:
  if value & (value - 1):
    raise ValueError(f"the latent decode kernel needs a power-of-two {name}, got {value}")


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "interpret",
                                             "pages_per_block"))
def mla_decode_attention(q: jax.Array, pages: jax.Array, block_tables: jax.Array,
                         seq_lens: jax.Array, *, scale: float, value_dim: int,
                         interpret: bool = False, pages_per_block: int = PAGES_PER_BLOCK
                         ) -> jax.Array:
  """q [B, N, R + r]; pages [P, page_size, 1, R + r] (f32 | bf16); block_tables [B, W]
  int32 (pool rows); seq_lens [B] int32 (0: no keys, output zeros) -> [B, N, R] in q's
  dtype, R = `value_dim`. R, r, page_size and `pages_per_block` powers of two."""
  batch, heads, row = q.shape
  num_pages, page_size, _, pool_row = pages.shape
  rope = row - value_dim
  if pool_row != row or rope <= 0:
    raise ValueError(f"query rows of {row} do not match pool rows of {pool_row} with a "
                     f"latent of {value_dim}")
  for name, value in (("latent", value_dim), ("rope dim", rope), ("page_size", page_size)):
    _check_pow2(name, value)
  ppb = min(pages_per_block, pl.next_power_of_2(block_tables.shape[1]))
  _check_pow2("pages_per_block", ppb)
  width = pl.cdiv(block_tables.shape[1], ppb) * ppb
  tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))
  padded = pl.cdiv(heads, HEADS_PER_BLOCK) * HEADS_PER_BLOCK
  qp = jnp.pad(q.astype(pages.dtype), ((0, 0), (0, padded - heads), (0, 0)))
  kernel = functools.partial(_kernel, latent=value_dim, rope=rope, pages_per_block=ppb,
                             scale=scale)
  out = pl.pallas_call(
      kernel,
      grid=(batch, padded // HEADS_PER_BLOCK),
      in_specs=[pl.BlockSpec((None, HEADS_PER_BLOCK, row), lambda b, h: (b, h, 0)),
                pl.BlockSpec((num_pages, page_size, None, row), lambda b, h: (0, 0, 0, 0)),
                pl.BlockSpec((None, width), lambda b, h: (b, 0)),
                pl.BlockSpec((batch,), lambda b, h: (0,))],
      out_specs=pl.BlockSpec((None, HEADS_PER_BLOCK, value_dim), lambda b, h: (b, h, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, padded, value_dim), q.dtype),
      interpret=interpret,
  )(qp, pages, tables, seq_lens)
  return out[:, :heads]


def ref_mla_decode_attention(q: jax.Array, pages: jax.Array, block_tables: jax.Array,
                             seq_lens: jax.Array, *, scale: float, value_dim: int
                             ) -> jax.Array:
  """Pure-jnp reference of `mla_decode_attention`: every row's pages gathered whole."""
  rows = pages[block_tables][:, :, :, 0].astype(jnp.float32)  # [B, W, ps, C]
  rows = rows.reshape(rows.shape[0], -1, rows.shape[-1])  # [B, S, C]
  s = jnp.einsum("bnc,bsc->bns", q.astype(jnp.float32), rows) * scale
  valid = jnp.arange(rows.shape[1])[None, :] < seq_lens[:, None]  # [B, S]
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  p = jnp.where(valid[:, None, :], jax.nn.softmax(s, axis=-1), 0.0)
  values = jnp.where(valid[:, :, None], rows[..., :value_dim], 0.0)
  return jnp.einsum("bns,bsr->bnr", p, values).astype(q.dtype)
