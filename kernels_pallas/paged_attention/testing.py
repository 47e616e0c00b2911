"""Builders of random paged-attention inputs for tests and benchmarks.

Pages are handed out in a shuffled order from a small pool whose page 0 is the
reserved dummy page. Everything a correct kernel must never read is poisoned:
unused pages and the unused tail of each sequence's last page hold NaN, and
block-table entries past a sequence's pages are garbage (ids of NaN pages or
out-of-range ids). Any out-of-bounds read then shows up as NaN in the output.
With a sliding ``window``, the pages wholly behind the window of a sequence's
oldest query are poisoned too: the engine releases them for reuse, so they
may hold anything while the block table still names them.
With ``kv_quant`` the pools are quantized to the uint8 ``[..., H + 4]`` layout
(``quantize_pages``); poisoned rows get a NaN scale, so they still read as NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention import common

_QMAX = {"int8": 127.0, "fp8": 448.0}


@dataclasses.dataclass(frozen=True)
class PagedInputs:
  """Arrays of one paged-attention call (decode: ``lens`` = seq_lens)."""

  q: jnp.ndarray
  k_pages: jnp.ndarray
  v_pages: jnp.ndarray
  block_tables: jnp.ndarray
  lens: jnp.ndarray
  cu_q_lens: jnp.ndarray | None = None


def quantize_pages(pages, kv_quant: str):
  """float [..., H] -> uint8 [..., H + 4]: absmax codes of each row, then its float32 scale.

  The layout of the engine's int8 / fp8 KV cache (serving/runner/kv_cache.py).
  A row holding NaN gets a NaN scale.
  """
  qmax = _QMAX[kv_quant]
  x = jnp.asarray(pages, jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / qmax
  inv = jnp.where(scale > 0, 1.0 / scale, 0.0)[..., None]
  scaled = jnp.clip(x * inv, -qmax, qmax)
  if kv_quant == "int8":
    scaled = jnp.round(scaled)
  codes = jax.lax.bitcast_convert_type(scaled.astype(common.CODE_DTYPES[kv_quant]), jnp.uint8)
  return jnp.concatenate([codes, jax.lax.bitcast_convert_type(scale, jnp.uint8)], axis=-1)


def _page_pool(rng, kv_lens, *, page_size, num_kv_heads, head_dim, pages_per_seq, spare_pages,
               dtype, poison, kv_quant=None, released=None):
  """K/V page pools and block tables holding ``kv_lens[s]`` keys for each sequence;
  with ``poison``, the pages holding only keys below ``released[s]`` are NaN."""
  needed = [-(-n // page_size) for n in kv_lens]
  if max(needed, default=0) > pages_per_seq:
    raise ValueError(f"{pages_per_seq=} too small for {kv_lens=}")
  num_pages = 1 + sum(needed) + spare_pages
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  fill = np.nan if poison else 0.0
  k = np.full(shape, fill, np.float32)
  v = np.full(shape, fill, np.float32)
  order = rng.permutation(np.arange(1, num_pages))
  unused = order[sum(needed):]
  tables = np.zeros((len(kv_lens), pages_per_seq), np.int32)
  nxt = 0
  for s, (n, n_pages) in enumerate(zip(kv_lens, needed, strict=True)):
    pages = order[nxt:nxt + n_pages]
    nxt += n_pages
    tables[s, :n_pages] = pages
    garbage = [num_pages + 7, -1, *unused] if poison else [0]
    tables[s, n_pages:] = rng.choice(garbage, size=pages_per_seq - n_pages)
    for j, page in enumerate(pages):
      rows = min(page_size, n - j * page_size)
      k[page, :rows] = rng.standard_normal((rows, num_kv_heads, head_dim))
      v[page, :rows] = rng.standard_normal((rows, num_kv_heads, head_dim))
    gone = (released[s] if poison and released else 0) // page_size  # pages behind the window
    k[pages[:gone]], v[pages[:gone]] = np.nan, np.nan
  if kv_quant:
    return quantize_pages(k, kv_quant), quantize_pages(v, kv_quant), jnp.asarray(tables)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables)


def make_decode_inputs(seed, seq_lens, *, page_size, num_kv_heads, group, head_dim, dtype,
                       kv_dtype=None, pages_per_seq=None, spare_pages=2,
                       poison=True, kv_quant=None, window=None) -> PagedInputs:
  """Random decode inputs: q [B, K*group, H] and a poisoned page pool (``kv_dtype``,
  or quantized uint8 [..., H + 4] with ``kv_quant``; pages behind ``window``
  poisoned as released)."""
  rng = np.random.default_rng(seed)
  if pages_per_seq is None:
    pages_per_seq = max(1, max(-(-n // page_size) for n in seq_lens) + 1)
  k, v, tables = _page_pool(
    rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
    pages_per_seq=pages_per_seq, spare_pages=spare_pages, dtype=kv_dtype or dtype,
    poison=poison, kv_quant=kv_quant,
    released=None if window is None else [max(n - window, 0) for n in seq_lens])
  q = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim))
  return PagedInputs(jnp.asarray(q, dtype), k, v, tables, jnp.asarray(seq_lens, jnp.int32))


def make_ragged_inputs(seed, q_lens, kv_lens, *, num_tokens, page_size, num_kv_heads, group,
                       head_dim, dtype, kv_dtype=None, pages_per_seq=None, spare_pages=2,
                       poison=True, kv_quant=None, window=None) -> PagedInputs:
  """Random ragged inputs: q [num_tokens, K*group, H]; rows past sum(q_lens) are padding;
  pages behind ``window`` of each sequence's oldest query poisoned as released."""
  if any(ql > kl for ql, kl in zip(q_lens, kv_lens, strict=True)):
    raise ValueError(f"each q_len must be <= its kv_len: {q_lens=} {kv_lens=}")
  if sum(q_lens) > num_tokens:
    raise ValueError(f"{num_tokens=} < sum of {q_lens=}")
  rng = np.random.default_rng(seed)
  if pages_per_seq is None:
    pages_per_seq = max(1, max(-(-n // page_size) for n in kv_lens) + 1)
  k, v, tables = _page_pool(
    rng, kv_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
    pages_per_seq=pages_per_seq, spare_pages=spare_pages, dtype=kv_dtype or dtype,
    poison=poison, kv_quant=kv_quant,
    released=None if window is None else [max(kv - ql - window + 1, 0) if ql else 0
                                          for ql, kv in zip(q_lens, kv_lens, strict=True)])
  q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
  if poison:
    q[sum(q_lens):] = np.nan
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return PagedInputs(jnp.asarray(q, dtype), k, v, tables, jnp.asarray(kv_lens, jnp.int32),
                     jnp.asarray(cu))


def tolerance(dtype) -> dict[str, float]:
  """assert_allclose tolerances for a kernel-vs-reference comparison."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    return {"atol": 2e-2, "rtol": 2e-2}
  return {"atol": 2e-5, "rtol": 2e-5}
