"""Paged attention for the engine, with a backend switch.

- `xla`: the pure-jnp paged attention below. It gathers only the pages named
  by the block table (whose width the scheduler buckets to the longest
  sequence in the batch), so cost follows the context in use, not
  `max_model_len`. It is the CPU path.
- `pallas`: `kernels_pallas` (Mosaic TPU on TPU, the GPU kernel on GPU).
- `pallas_interpret`: the same kernels in Pallas interpret mode (CPU tests).
- `auto`: `pallas` on TPU/GPU, `xla` on CPU.

Block tables hold per-layer page ids; both entry points add `layer * P`
(see kv_cache.py). Letters: B batch, T query tokens, S key tokens,
N query heads, K kv heads, G = N/K, H head dim, W block-table width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.kv_cache import KVCache, from_storage

_NEG = -1e30


def resolve_backend(backend: str, platform: str | None = None) -> str:
  """Maps a configured backend (incl. "auto") to "xla" | "pallas" | "pallas_interpret"."""
  platform = platform or jax.default_backend()
  if backend == "auto":
    return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"
  if backend == "pallas" and platform == "cpu":
    raise ValueError("attention_backend='pallas' needs a TPU or GPU; use 'pallas_interpret' "
                     "to run the kernels on CPU")
  return backend


def _kernel_impl() -> str:
  return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _gather_pages(pages: jax.Array, block_tables: jax.Array, kv: KVCache) -> jax.Array:
  """pages [L*P, ps, K, H], block_tables [..., W] -> [..., W*ps, K, H] (compute dtype)."""
  g = from_storage(pages[block_tables], kv)  # [..., W, ps, K, H]
  return g.reshape(*block_tables.shape[:-1], -1, *pages.shape[2:])


def _softcap(s: jax.Array, soft_cap: float | None) -> jax.Array:
  return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def xla_decode_attention(q, kv: KVCache, block_tables, seq_lens, *, scale: float,
                         sliding_window: int | None = None, soft_cap: float | None = None):
  """q [B, N, H]; block_tables [B, W] (already layer-offset); seq_lens [B] -> [B, N, H]."""
  b, n, h = q.shape
  nk = kv.k.shape[2]
  k = _gather_pages(kv.k, block_tables, kv)  # [B, S, K, H]
  v = _gather_pages(kv.v, block_tables, kv)
  qg = q.reshape(b, nk, n // nk, h)  # [B, K, G, H]
  s = jnp.einsum("bkgh,bskh->bkgs", qg.astype(k.dtype), k,
                 preferred_element_type=jnp.float32) * scale
  s = _softcap(s, soft_cap)
  pos = jnp.arange(k.shape[1])[None, :]  # [1, S]
  valid = pos < seq_lens[:, None]
  if sliding_window is not None:
    valid &= pos > seq_lens[:, None] - 1 - sliding_window
  s = jnp.where(valid[:, None, None, :], s, _NEG)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(valid[:, None, None, :], p, 0.0)
  out = jnp.einsum("bkgs,bskh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, n, h).astype(q.dtype)


def xla_ragged_attention(q, kv: KVCache, block_tables, cu_q_lens, kv_lens, *, scale: float,
                         sliding_window: int | None = None, soft_cap: float | None = None):
  """Causal attention of S sequences' new queries over their pages.

  q [T, N, H] (sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]); block_tables
  [S, W] (layer-offset); kv_lens [S] keys per sequence including the new
  queries. Cost is O(T * S * W * page_size): the engine sends one sequence
  per prefill call (S = 1), where it is plain causal attention.
  """
  t, n, h = q.shape
  nseq = block_tables.shape[0]
  nk = kv.k.shape[2]
  k = _gather_pages(kv.k, block_tables, kv)  # [S, Skv, K, H]
  v = _gather_pages(kv.v, block_tables, kv)
  rows = jnp.arange(t)
  seg = jnp.sum(rows[:, None] >= cu_q_lens[None, 1:], axis=1)  # [T] sequence of each row
  seg_c = jnp.minimum(seg, nseq - 1)
  q_len = cu_q_lens[seg_c + 1] - cu_q_lens[seg_c]
  q_pos = kv_lens[seg_c] - q_len + (rows - cu_q_lens[seg_c])  # [T]
  key_pos = jnp.arange(k.shape[1])  # [Skv]
  # [T, S, Skv]: key of sequence s at position j is visible to row t
  valid = (seg[:, None, None] == jnp.arange(nseq)[None, :, None]) & (
      key_pos[None, None, :] <= q_pos[:, None, None]) & (
          key_pos[None, None, :] < kv_lens[None, :, None])
  if sliding_window is not None:
    valid &= key_pos[None, None, :] > q_pos[:, None, None] - sliding_window
  qg = q.reshape(t, nk, n // nk, h)  # [T, K, G, H]
  s = jnp.einsum("tkgh,sjkh->tkgsj", qg.astype(k.dtype), k,
                 preferred_element_type=jnp.float32) * scale
  s = _softcap(s, soft_cap)
  vmask = valid[:, None, None, :, :]  # [T, 1, 1, S, Skv]
  s = jnp.where(vmask, s, _NEG)
  p = jax.nn.softmax(s.reshape(t, nk, n // nk, -1), axis=-1).reshape(s.shape)
  p = jnp.where(vmask, p, 0.0)
  out = jnp.einsum("tkgsj,sjkh->tkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(t, n, h).astype(q.dtype)


def decode_attention(backend: str, q, kv: KVCache, block_tables, seq_lens, **kw):
  """Dispatches decode attention to the resolved backend (see module docstring)."""
  if backend == "xla":
    return xla_decode_attention(q, kv, block_tables, seq_lens, **kw)
  import kernels_pallas
  return kernels_pallas.paged_decode_attention(
      q, from_storage(kv.k, kv), from_storage(kv.v, kv), block_tables, seq_lens,
      impl=_kernel_impl(), interpret=backend == "pallas_interpret", **kw)


def ragged_attention(backend: str, q, kv: KVCache, block_tables, cu_q_lens, kv_lens, **kw):
  """Dispatches prefill (ragged) attention to the resolved backend."""
  if backend == "xla":
    return xla_ragged_attention(q, kv, block_tables, cu_q_lens, kv_lens, **kw)
  import kernels_pallas
  return kernels_pallas.ragged_paged_attention(
      q, from_storage(kv.k, kv), from_storage(kv.v, kv), block_tables, cu_q_lens, kv_lens,
      impl=_kernel_impl(), interpret=backend == "pallas_interpret", **kw)
