"""Paged attention for the engine, with a backend switch.

- `xla`: the pure-jnp paged attention below: a flash-style loop over blocks
  of pages that stops at the longest sequence, so cost follows the context
  in use, not `max_model_len`, and one program serves every context length.
  It is the CPU path. Decode and verification rows (a few queries per row)
  take the native kernel instead where it is built and this CPU runs it
  (`kernels_cpu.paged_attention`: keys read in place, no block copies), on
  one device, and so do a step's prefill chunks, as one-query rows
  (`native_prefill_attention`). Without the kernel, a step's prefill chunks
  run in one call, packed back to back; attention regroups their rows into
  per-chunk query blocks (`QueryBlocks`) and runs the blocked loop per block
  (batched dots).
- `pallas`: `kernels_pallas` (Mosaic TPU on TPU, the GPU kernel on GPU). The
  kernels take the pool as stored: int8 / fp8 pages go in quantized
  (`kv_quant`) and are dequantized per block inside the kernel.
- `pallas_interpret`: the same kernels in Pallas interpret mode (CPU tests).
- `auto`: `pallas` on TPU/GPU, `xla` on CPU.

Every entry point takes `sliding_window` (None; a Python int w: keys at
positions > q_pos - w only; or a traced int32 scalar, as when the layers are a
`lax.scan` and each has its own window, where a value <= 0 means no window),
`soft_cap` (None, or c: scores become c * tanh(s / c)) and `sinks` (None, or
[N] float32 per-head sink logits, GPT-OSS: the logit joins each row's softmax
denominator and contributes no value; the online softmax starts from m = sink,
l = 1). Soft capping applies to the q.k scores only, never to the sink.

Block tables hold per-layer page ids; both entry points add `layer * P`
(see kv_cache.py). Letters: B batch, T query tokens, S key tokens,
N query heads, K kv heads, G = N/K, H head dim, W block-table width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import kernels_cpu
from serving.runner.kv_cache import QUANTIZED_DTYPES, KVCache, from_storage

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


def _kernel_pages(kv: KVCache) -> tuple[jax.Array, jax.Array, dict]:
  """The pools and `kv_quant` option for `kernels_pallas`: quantized pages as stored,
  bfloat16 pages bitcast from their uint16 storage (free), never a dequantized pool."""
  if kv.dtype in QUANTIZED_DTYPES:
    return kv.k, kv.v, dict(kv_quant=kv.dtype)
  return from_storage(kv.k, kv), from_storage(kv.v, kv), {}


def _gather_pages(pages: jax.Array, block_tables: jax.Array, kv: KVCache) -> jax.Array:
  """pages [L*P, ps, K, H], block_tables [..., W] -> [..., W*ps, K, H] (compute dtype)."""
  g = from_storage(pages[block_tables], kv)  # [..., W, ps, K, H]
  return g.reshape(*block_tables.shape[:-1], -1, *g.shape[-2:])


def _softcap(s: jax.Array, soft_cap: float | None) -> jax.Array:
  return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _static_window(sliding_window) -> bool:
  """Whether a (not None) window is a Python int, not a traced scalar."""
  return isinstance(sliding_window, (int, np.integer))


def _in_window(key_pos, q_pos, sliding_window) -> jax.Array:
  """Keys at `key_pos` inside the window of queries at `q_pos` (broadcasting); a traced
  window <= 0 means none."""
  inside = key_pos > q_pos - sliding_window
  return inside if _static_window(sliding_window) else inside | (sliding_window <= 0)


def _first_block(lens: jax.Array, sliding_window, span: int):
  """The first block of `span` keys any query needs: 0, or with a window the block of the
  oldest key the row with the fewest keys (`lens`, 0: a query with none) still sees."""
  if sliding_window is None:
    return 0
  shortest = jnp.min(jnp.where(lens > 0, lens, jnp.iinfo(jnp.int32).max))
  first = jnp.maximum(shortest - sliding_window, 0) // span
  return first if _static_window(sliding_window) else jnp.where(sliding_window > 0, first, 0)


def _softmax_init(shape: tuple[int, ...], sink: jax.Array | None):
  """(m, l) that start an online softmax over rows `shape`: (-inf, 0), or with the rows'
  sink logits (`sink`, broadcastable to `shape`) m = sink and l = exp(sink - sink) = 1:
  the sink joins the denominator as a key with no value."""
  if sink is None:
    return jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32)
  return jnp.broadcast_to(sink.astype(jnp.float32), shape), jnp.ones(shape, jnp.float32)


def _online_softmax_update(carry, s, v, valid):
  """One key block of flash-style attention.

  carry: (m [..., Q], l [..., Q], acc [..., Q, H]); s [..., Q, S] f32 scores;
  v [..., S, H]; valid [..., Q, S] (broadcastable).
  """
  m, l, acc = carry
  s = jnp.where(valid, s, _NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  l = l * alpha + jnp.sum(p, axis=-1)
  acc = acc * alpha[..., None] + jnp.einsum("...qs,...sh->...qh", p.astype(v.dtype), v,
                                            preferred_element_type=jnp.float32)
  return m_new, l, acc


def _block_pages(width: int, page_size: int, block_tokens: int) -> int:
  pages = max(1, block_tokens // page_size)
  if width % pages:
    raise ValueError(f"block table width {width} is not a multiple of {pages} pages per block")
  return pages


def xla_decode_attention(q, kv: KVCache, block_tables, seq_lens, *, scale: float,
                         sliding_window=None, soft_cap: float | None = None,
                         sinks: jax.Array | None = None, block_tokens: int = 128):
  """q [B, N, H]; block_tables [B, W] (layer-offset); seq_lens [B] -> [B, N, H].

  One query per row: `xla_multi_query_attention` with T = 1.
  """
  out, kv = xla_multi_query_attention(q[:, None], kv, block_tables, seq_lens[:, None],
                                      scale=scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks, block_tokens=block_tokens)
  return out[:, 0], kv


def xla_multi_query_attention(q, kv: KVCache, block_tables, q_lens, *, scale: float,
                              sliding_window=None, soft_cap: float | None = None,
                              sinks: jax.Array | None = None, block_tokens: int = 128):
  """q [B, T, N, H]; block_tables [B, W] (layer-offset); q_lens [B, T] -> [B, T, N, H].

  Query t of row b attends to the row's first `q_lens[b, t]` keys (0: none; its
  output is then zeros, or to be ignored): a decode step is T = 1, a speculative
  step's verification T = drafts + 1 with q_lens = positions + 1 (causal). Each key
  block is gathered once per row for all its queries. A while loop over blocks
  of `block_tokens` keys runs only up to the longest row in the batch (and, with a
  window, from the block the shortest row's window starts in), so the cost follows
  the context in use, not W. `sliding_window`, `soft_cap`, `sinks`: module doc.
  """
  b, t, n, h = q.shape
  ps, nk = kv.k.shape[1], kv.k.shape[2]
  bp = _block_pages(block_tables.shape[1], ps, block_tokens)
  # [B, T, N, H] -> [B, K, G, T, H]
  qg = jnp.transpose(q.reshape(b, t, nk, n // nk, h), (0, 2, 3, 1, 4)).astype(kv.compute_dtype)
  n_blocks = (jnp.max(q_lens) + bp * ps - 1) // (bp * ps)

  def body(i, carry):
    kc, vc, carry = carry[0], carry[1], carry[2:]
    tables = jax.lax.dynamic_slice_in_dim(block_tables, i * bp, bp, axis=1)  # [B, bp]
    k = _gather_pages(kc, tables, kv)  # [B, S, K, H]
    v = _gather_pages(vc, tables, kv)
    s = jnp.einsum("bkgth,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = _softcap(s, soft_cap)  # [B, K, G, T, S]
    pos = i * bp * ps + jnp.arange(bp * ps)[None, None, :]  # [1, 1, S]
    valid = pos < q_lens[:, :, None]  # [B, T, S]
    if sliding_window is not None:
      valid &= _in_window(pos, q_lens[:, :, None] - 1, sliding_window)
    # Zero values of keys no query sees: pages past a sequence may hold anything (NaN).
    v = jnp.where(jnp.any(valid, axis=1)[:, :, None, None], v, 0)
    vk = jnp.swapaxes(v, 1, 2)[:, :, None]  # [B, K, 1, S, H]
    return kc, vc, *_online_softmax_update(carry, s, vk, valid[:, None, None])

  sink = None if sinks is None else sinks.reshape(1, nk, n // nk, 1)
  m, l = _softmax_init((b, nk, n // nk, t), sink)
  # The cache rides in the loop carry so XLA updates it in place afterwards.
  init = (kv.k, kv.v, m, l, jnp.zeros((b, nk, n // nk, t, h), jnp.float32))
  first = _first_block(q_lens, sliding_window, bp * ps)
  kc, vc, _, l, acc = jax.lax.fori_loop(first, n_blocks, body, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, H]
  # [B, K, G, T, H] -> [B, T, N, H]
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)
  return out.astype(q.dtype), dataclasses.replace(kv, k=kc, v=vc)


def _attend_table(q, lens, table, kc, vc, kv: KVCache, *, scale: float, block_pages: int,
                  sliding_window, soft_cap: float | None, sinks: jax.Array | None):
  """Queries of one sequence over its pages (flash-style): q [Q, N, H]; lens [Q] keys
  each query sees (its position + 1; 0: none); table [W] (layer-offset). Loops over
  key blocks up to max(lens) -> (kc, vc, out [Q, N, H] float32). The pools ride in
  the loop carry so that XLA updates them in place afterwards."""
  nq, n, h = q.shape
  ps, nk = kv.k.shape[1], kv.k.shape[2]
  g, span = n // nk, block_pages * ps
  # [Q, N, H] -> [K, G*Q, H]; lens in the same (G, Q) order
  qg = jnp.transpose(q.reshape(nq, nk, g, h), (1, 2, 0, 3)).reshape(nk, g * nq, h)
  qg, lens = qg.astype(kv.compute_dtype), jnp.tile(lens, g)

  def body(i, carry):
    kc, vc, carry = carry[0], carry[1], carry[2:]
    tbl = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages)
    k = jnp.swapaxes(_gather_pages(kc, tbl, kv), 0, 1)  # [K, S, H]
    v = jnp.swapaxes(_gather_pages(vc, tbl, kv), 0, 1)
    s = jnp.einsum("kqh,ksh->kqs", qg, k, preferred_element_type=jnp.float32) * scale
    s = _softcap(s, soft_cap)
    pos = i * span + jnp.arange(span)  # [S]
    valid = pos[None, :] < lens[:, None]  # [G*Q, S]
    if sliding_window is not None:
      valid &= _in_window(pos[None, :], lens[:, None] - 1, sliding_window)
    v = jnp.where(jnp.any(valid, axis=0)[None, :, None], v, 0)  # unseen keys may be NaN
    return kc, vc, *_online_softmax_update(carry, s, v, valid[None])

  # sinks [N] -> [K, G, 1] -> [K, G*Q] in the rows' (G, Q) order
  sink = None if sinks is None else jnp.repeat(sinks.reshape(nk, g), nq, axis=1)
  m, l = _softmax_init((nk, g * nq), sink)
  init = (kc, vc, m, l, jnp.zeros((nk, g * nq, h), jnp.float32))
  first = _first_block(lens, sliding_window, span)
  kc, vc, _, l, acc = jax.lax.fori_loop(first, (jnp.max(lens) + span - 1) // span, body, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]  # [K, G*Q, H] -> [Q, N, H]
  return kc, vc, jnp.transpose(out.reshape(nk, g, nq, h), (2, 0, 1, 3)).reshape(nq, n, h)


def xla_prefill_attention(q, kv: KVCache, block_table, q_start, kv_len, *, scale: float,
                          sliding_window=None, soft_cap: float | None = None,
                          sinks: jax.Array | None = None, block_tokens: int = 128):
  """One sequence's chunk, causal over its pages (flash-style, XLA).

  q [T, N, H], row i at position q_start + i; block_table [W] (layer-offset);
  kv_len [] keys in the cache after the chunk. Loops over key blocks up to
  kv_len only. Padding rows (positions >= kv_len) produce values to ignore.
  """
  lens = jnp.minimum(q_start + jnp.arange(q.shape[0]) + 1, kv_len)
  bp = _block_pages(block_table.shape[0], kv.k.shape[1], block_tokens)
  kc, vc, out = _attend_table(q, lens, block_table, kv.k, kv.v, kv, scale=scale,
                              block_pages=bp, sliding_window=sliding_window, soft_cap=soft_cap,
                              sinks=sinks)
  return out.astype(q.dtype), dataclasses.replace(kv, k=kc, v=vc)


PREFILL_QUERY_BLOCK = 64  # query rows per block of `xla_block_prefill_attention`


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QueryBlocks:
  """Prefill chunks' query rows regrouped into blocks of Q rows of one chunk each.

  Host-built (serving/runner/inputs.py) next to the packed layout the matmuls
  use, so the XLA path can attend chunk by chunk without a [T, chunks, keys]
  mask: block j holds queries of chunk `chunk[j]` only.
  """

  rows: jax.Array  # [QB, Q] int32 packed row of each block query (padding: 0)
  q_lens: jax.Array  # [QB, Q] int32 keys each query sees: its position + 1 (padding: 0)
  chunk: jax.Array  # [QB] int32 the block-table row (chunk) of each block
  count: jax.Array  # [] int32 blocks in use (the first `count`; the rest are padding)
  unblock: jax.Array  # [T] int32 each packed row's index in the flat [QB * Q] output


def xla_block_prefill_attention(q, kv: KVCache, block_tables, blocks: QueryBlocks, *,
                                scale: float, sliding_window=None,
                                soft_cap: float | None = None, sinks: jax.Array | None = None,
                                block_tokens: int = 128):
  """Causal attention of several prefill chunks in one call (flash-style, XLA).

  q [T, N, H] packed rows; block_tables [C, W] (layer-offset), one per chunk;
  `blocks` regroups the rows by chunk. A loop over the blocks in use, each
  looping over its own chunk's key blocks up to its last query, so the cost
  is the chunks' own (causal) work, whatever the bucket and chunk count.
  Padding rows produce values to ignore.
  """
  n, h = q.shape[1:]
  nb, qlen = blocks.rows.shape
  bp = _block_pages(block_tables.shape[1], kv.k.shape[1], block_tokens)
  q_blocks = q[blocks.rows]  # [QB, Q, N, H]

  def one_block(j, carry):
    kc, vc, out = carry
    kc, vc, o = _attend_table(q_blocks[j], blocks.q_lens[j], block_tables[blocks.chunk[j]],
                              kc, vc, kv, scale=scale, block_pages=bp,
                              sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return kc, vc, jax.lax.dynamic_update_index_in_dim(out, o.astype(out.dtype), j, 0)

  out = jnp.zeros((nb, qlen, n, h), q.dtype)
  kc, vc, out = jax.lax.fori_loop(0, blocks.count, one_block, (kv.k, kv.v, out))
  return out.reshape(nb * qlen, n, h)[blocks.unblock], dataclasses.replace(kv, k=kc, v=vc)


def xla_ragged_attention(q, kv: KVCache, block_tables, cu_q_lens, kv_lens, *, scale: float,
                         sliding_window=None, soft_cap: float | None = None,
                         sinks: jax.Array | None = None):
  """Causal attention of B sequences' new queries over their pages.

  q [T, N, H] (sequence b owns rows cu_q_lens[b]:cu_q_lens[b+1]); block_tables
  [B, W] (layer-offset); kv_lens [B] keys per sequence including the new
  queries. Cost is O(T * B * W * page_size): a reference for small cases; the
  engine's chunks take `xla_block_prefill_attention`.
  """
  t, n, h = q.shape
  nseq = block_tables.shape[0]
  nk = kv.k.shape[2]
  k = _gather_pages(kv.k, block_tables, kv)  # [B, S, K, H]
  v = _gather_pages(kv.v, block_tables, kv)
  kpos = jnp.arange(k.shape[1])
  v = jnp.where((kpos[None, :] < kv_lens[:, None])[:, :, None, None], v, 0)  # NaN-safe
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
    valid &= _in_window(key_pos[None, None, :], q_pos[:, None, None], sliding_window)
  qg = q.reshape(t, nk, n // nk, h)  # [T, K, G, H]
  s = jnp.einsum("tkgh,sjkh->tkgsj", qg.astype(k.dtype), k,
                 preferred_element_type=jnp.float32) * scale
  s = _softcap(s, soft_cap)
  vmask = valid[:, None, None, :, :]  # [T, 1, 1, S, Skv]
  s = jnp.where(vmask, s, _NEG)
  m = jnp.max(s, axis=(3, 4))  # [T, K, G]
  sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, nk, n // nk)
  if sink is not None:
    m = jnp.maximum(m, sink)
  p = jnp.where(vmask, jnp.exp(s - m[..., None, None]), 0.0)
  denom = jnp.sum(p, axis=(3, 4))
  if sink is not None:
    denom += jnp.exp(sink - m)
  out = jnp.einsum("tkgsj,sjkh->tkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out / jnp.maximum(denom, 1e-30)[..., None]
  return out.reshape(t, n, h).astype(q.dtype)


def native_supported(q_shape: tuple[int, ...], kv: KVCache, prefill: bool = False) -> bool:
  """Whether the XLA path runs queries `[B, T, N, H]` through the native CPU kernel:
  built and runnable here, a pool dtype it reads, and no mesh (XLA cannot split a
  custom call; it would gather the pool for it). `prefill`: a step's packed chunks as
  B one-query rows (`native_prefill_attention`; `XLASERVE_NATIVE_PREFILL=0` turns
  that off)."""
  if jax.default_backend() != "cpu" or not kernels_cpu.available():
    return False
  if prefill and not kernels_cpu.paged_attention.prefill_enabled():
    return False
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    return False
  return kernels_cpu.paged_attention.supports(q_shape, kv.k, kv.dtype)


def packed_row_keys(cu_q_lens, kv_lens, num_rows: int, num_chunks: int):
  """Packed prefill rows as one-query rows: for each of `num_rows` rows, its chunk c
  (rows cu_q_lens[c]:cu_q_lens[c+1], the chunk's keys already written) and how many
  keys it sees, kv_lens[c] - (q_len_c - 1 - j) for its index j in the chunk (causal);
  padding rows see none -> (chunk [T] int32, keys [T])."""
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  chunk = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0,
                   num_chunks - 1).astype(jnp.int32)
  q_len = cu_q_lens[chunk + 1] - cu_q_lens[chunk]
  keys = kv_lens[chunk] - (q_len - 1 - (rows - cu_q_lens[chunk]))
  return chunk, jnp.where(rows < cu_q_lens[-1], keys, 0)


def native_prefill_attention(q, kv: KVCache, block_tables, cu_q_lens, kv_lens, *,
                             scale: float, sliding_window=None, soft_cap: float | None = None,
                             sinks: jax.Array | None = None):
  """`ragged_attention`'s contract through the native kernel -> (out [T, N, H], kv).

  Each packed row is one query over its own sequence's table: row i of chunk c
  (rows cu_q_lens[c]:cu_q_lens[c+1], the chunk's K/V already written) sees the
  first kv_lens[c] - (q_len_c - 1 - j) keys, j its index in the chunk (causal);
  padding rows see none. Keys are read in place in the pool, once per query:
  the XLA path's per-block gathers into dot layouts cost ~10 ms per layer for a
  512-token step (docs/performance.md).
  """
  chunk, keys = packed_row_keys(cu_q_lens, kv_lens, q.shape[0], block_tables.shape[0])
  out, kv = native_multi_query_attention(q[:, None], kv, block_tables[chunk], keys[:, None],
                                         scale=scale, sliding_window=sliding_window,
                                         soft_cap=soft_cap, sinks=sinks)
  return out[:, 0], kv


def native_multi_query_attention(q, kv: KVCache, block_tables, q_lens, *, scale: float,
                                 sliding_window=None, soft_cap: float | None = None,
                                 sinks: jax.Array | None = None):
  """`xla_multi_query_attention`'s contract through the native kernel -> (out, kv)."""
  out = kernels_cpu.paged_attention.paged_attention(
      q, kv.k, kv.v, block_tables, q_lens, kv_dtype=kv.dtype, scale=scale,
      sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
  return out.astype(q.dtype), kv


def decode_attention(backend: str, q, kv: KVCache, block_tables, seq_lens, *,
                     block_tokens: int = 128, **kw):
  """Dispatches decode attention to the resolved backend; returns (out, kv).

  `kw`: scale, and optionally sliding_window, soft_cap, sinks (module doc)."""
  if backend == "xla" and native_supported((q.shape[0], 1, *q.shape[1:]), kv):
    out, kv = native_multi_query_attention(q[:, None], kv, block_tables, seq_lens[:, None], **kw)
    return out[:, 0], kv
  if backend == "xla":
    return xla_decode_attention(q, kv, block_tables, seq_lens, block_tokens=block_tokens, **kw)
  import kernels_pallas
  k_pages, v_pages, quant = _kernel_pages(kv)
  return kernels_pallas.paged_decode_attention(
      q, k_pages, v_pages, block_tables, seq_lens, impl=_kernel_impl(),
      interpret=backend == "pallas_interpret", **quant, **kw), kv


def verify_attention(backend: str, q, kv: KVCache, block_tables, q_lens, *,
                     block_tokens: int = 128, **kw):
  """A speculative step's attention: q [B, T, N, H], q_lens [B, T] (module letters);
  returns (out [B, T, N, H], kv). The XLA path reads each row's keys once for its T
  queries; the kernels run the B*T queries as decode rows over the row's table."""
  if backend == "xla" and native_supported(q.shape, kv):
    return native_multi_query_attention(q, kv, block_tables, q_lens, **kw)
  if backend == "xla":
    return xla_multi_query_attention(q, kv, block_tables, q_lens, block_tokens=block_tokens,
                                     **kw)
  b, t = q_lens.shape
  out, kv = decode_attention(backend, q.reshape(b * t, *q.shape[2:]), kv,
                             jnp.repeat(block_tables, t, axis=0), q_lens.reshape(-1), **kw)
  return out.reshape(q.shape), kv


def ragged_attention(backend: str, q, kv: KVCache, block_tables, cu_q_lens, kv_lens, *,
                     blocks: QueryBlocks | None = None, block_tokens: int = 128, **kw):
  """Dispatches prefill (ragged) attention to the resolved backend; returns (out, kv).

  Sequence b owns rows cu_q_lens[b]:cu_q_lens[b+1] of q. The XLA path runs
  the engine's batched chunks through their `blocks`; without them it takes
  the blocked loop for one sequence, or the general gather formulation.
  """
  if backend == "xla" and native_supported((q.shape[0], 1, *q.shape[1:]), kv, prefill=True):
    return native_prefill_attention(q, kv, block_tables, cu_q_lens, kv_lens, **kw)
  if backend == "xla":
    if blocks is not None:
      return xla_block_prefill_attention(q, kv, block_tables, blocks,
                                         block_tokens=block_tokens, **kw)
    if block_tables.shape[0] == 1:
      q_start = kv_lens[0] - (cu_q_lens[1] - cu_q_lens[0])
      return xla_prefill_attention(q, kv, block_tables[0], q_start, kv_lens[0],
                                   block_tokens=block_tokens, **kw)
    return xla_ragged_attention(q, kv, block_tables, cu_q_lens, kv_lens, **kw), kv
  import kernels_pallas
  k_pages, v_pages, quant = _kernel_pages(kv)
  return kernels_pallas.ragged_paged_attention(
      q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, impl=_kernel_impl(),
      interpret=backend == "pallas_interpret", **quant, **kw), kv
