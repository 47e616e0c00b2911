"""The XLA paged attention equals dense causal attention on ragged lengths.

Pages not owned by a sequence (and the padding page) are filled with NaN,
so any read outside a sequence's own keys shows up in the output. Covered:
decode, verification, one-sequence and batched prefill and the general ragged
formulation; sliding windows (static, and traced per layer inside a scanned
layer stack), soft capping, GPT-OSS attention sinks, float32 / bfloat16 / int8
pools.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from serving.config import EngineConfig
from serving.runner import attention
from serving.runner.inputs import build_prefill_input
from serving.runner.kv_cache import KVCache, from_storage, quantize_rows
from serving.types import PrefillChunk, SamplingParams, Sequence


def dense_causal(q, k, v, q_pos, scale, window=None, soft_cap=None, sinks=None):
  """q [T, N, H] at positions q_pos; k, v [S, K, H] -> [T, N, H] (numpy, float64).

  `sinks` [N]: GPT-OSS (transformers' eager attention): each head's sink logit is one
  more column of the softmax, dropped afterwards."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  s = np.einsum("tnh,snh->nts", q, k) * scale
  if soft_cap is not None:
    s = soft_cap * np.tanh(s / soft_cap)
  pos = np.arange(k.shape[0])
  mask = pos[None, :] <= q_pos[:, None]
  if window is not None:
    mask &= pos[None, :] > q_pos[:, None] - window
  s = np.where(mask[None], s, -np.inf)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (*s.shape[:2], 1))
    s = np.concatenate([s, sink], axis=-1)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nts,snh->tnh", p[..., :k.shape[0]], v)


def make_cache(rng, lens, page_size, nk, h, num_pages, width):
  """A NaN-filled page pool holding each sequence's keys in shuffled pages."""
  k = np.full((num_pages, page_size, nk, h), np.nan, np.float32)
  v = np.full_like(k, np.nan)
  free = list(rng.permutation(np.arange(1, num_pages)))
  tables = np.zeros((len(lens), width), np.int32)
  dense = []
  for i, n in enumerate(lens):
    kd = rng.standard_normal((n, nk, h)).astype(np.float32)
    vd = rng.standard_normal((n, nk, h)).astype(np.float32)
    for j in range(-(-n // page_size)):
      page = free.pop()
      tables[i, j] = page
      chunk = slice(j * page_size, min(n, (j + 1) * page_size))
      k[page, :chunk.stop - chunk.start], v[page, :chunk.stop - chunk.start] = kd[chunk], vd[chunk]
    dense.append((kd, vd))
  cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), num_pages=num_pages, dtype="float32")
  return cache, tables, dense


@pytest.mark.parametrize("page_size,nk,g,window", [(4, 2, 2, None), (8, 1, 3, None),
                                                   (4, 3, 1, 5)])
def test_decode_matches_dense(page_size, nk, g, window):
  rng = np.random.default_rng(0)
  lens = [1, page_size, 2 * page_size + 3, 5 * page_size, 7]
  h, width = 16, 8
  cache, tables, dense = make_cache(rng, lens, page_size, nk, h, 48, width)
  q = rng.standard_normal((len(lens), nk * g, h)).astype(np.float32)
  out, _ = attention.xla_decode_attention(jnp.asarray(q), cache, jnp.asarray(tables),
                                          jnp.asarray(lens, jnp.int32), scale=h ** -0.5,
                                          sliding_window=window, block_tokens=2 * page_size)
  for i, n in enumerate(lens):
    ref = dense_causal(q[i:i + 1], *dense[i], np.array([n - 1]), h ** -0.5, window)
    np.testing.assert_allclose(np.asarray(out[i:i + 1]), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("start,num_q", [(0, 9), (5, 4), (16, 16), (3, 1)])
def test_prefill_matches_dense(start, num_q):
  rng = np.random.default_rng(1)
  page_size, nk, g, h = 4, 2, 2, 8
  total = start + num_q
  cache, tables, dense = make_cache(rng, [total], page_size, nk, h, 24, 12)
  t = 16  # bucketed rows; rows past num_q are padding
  q = rng.standard_normal((t, nk * g, h)).astype(np.float32)
  cu = jnp.asarray([0, num_q], jnp.int32)
  out, _ = attention.ragged_attention("xla", jnp.asarray(q), cache, jnp.asarray(tables), cu,
                                      jnp.asarray([total], jnp.int32), scale=h ** -0.5,
                                      block_tokens=8)
  ref = dense_causal(q[:num_q], *dense[0], start + np.arange(num_q), h ** -0.5)
  np.testing.assert_allclose(np.asarray(out[:num_q]), ref, rtol=2e-5, atol=2e-5)


def test_ragged_general_matches_dense():
  """Several sequences in one call (the general formulation)."""
  rng = np.random.default_rng(2)
  page_size, nk, g, h = 4, 2, 2, 8
  kv_lens, q_lens = [6, 13, 4], [2, 5, 4]
  cache, tables, dense = make_cache(rng, kv_lens, page_size, nk, h, 24, 4)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((cu[-1] + 3, nk * g, h)).astype(np.float32)
  out = attention.xla_ragged_attention(jnp.asarray(q), cache, jnp.asarray(tables),
                                       jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32),
                                       scale=h ** -0.5)
  for s, (n, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
    rows = slice(cu[s], cu[s + 1])
    ref = dense_causal(q[rows], *dense[s], n - ql + np.arange(ql), h ** -0.5)
    np.testing.assert_allclose(np.asarray(out[rows]), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("h", [8, 16])  # 16: the native kernel where built (one-query rows)
def test_batched_prefill_matches_dense(window, h):
  """A step's chunks in one call (the engine's path): packed rows, per-chunk query
  blocks (one chunk spans two), chunks starting mid-sequence, NaN everywhere else."""
  rng = np.random.default_rng(3)
  config = EngineConfig.of(page_size=4, max_model_len=128, attention_block_tokens=8,
                        max_num_batched_tokens=128, max_num_seqs=8)
  nk, g = 2, 2
  kv_lens, q_lens = [6, 13, 70, 4, 1], [2, 5, 70, 4, 1]
  cache, tables, dense = make_cache(rng, kv_lens, 4, nk, h, 40, config.block_table_width)
  chunks = []
  for i, (n, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
    seq = Sequence(request_id=str(i), prompt_ids=list(range(n)), params=SamplingParams(),
                   pages=[int(p) for p in tables[i] if p], decode_slot=i)
    chunks.append(PrefillChunk(seq, n - ql, n, sample=i % 2 == 0))
  inp, sampled = build_prefill_input(chunks, config)
  assert inp.tokens.shape == (128,) and inp.block_tables.shape[0] == 8  # 5 chunks: bucket 128
  assert sampled == ["0", "2", "4"]
  q = rng.standard_normal((128, nk * g, h)).astype(np.float32)
  args = (jnp.asarray(q), cache, jnp.asarray(inp.block_tables), jnp.asarray(inp.cu_q_lens),
          jnp.asarray(inp.kv_lens), jax.tree.map(jnp.asarray, inp.blocks))

  def call(q, cache, tables, cu_q_lens, kv_lens, blocks):
    return attention.ragged_attention("xla", q, cache, tables, cu_q_lens, kv_lens,
                                      blocks=blocks, scale=h ** -0.5, sliding_window=window,
                                      block_tokens=8)[0]

  native = h % 16 == 0 and kernels_cpu.available()
  assert ("xlaserve_paged_attention" in str(jax.make_jaxpr(call)(*args))) == native
  out = jax.jit(call)(*args)
  cu = inp.cu_q_lens
  for s, (n, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
    rows = slice(cu[s], cu[s + 1])
    ref = dense_causal(q[rows], *dense[s], n - ql + np.arange(ql), h ** -0.5, window)
    np.testing.assert_allclose(np.asarray(out[rows]), ref, rtol=2e-5, atol=2e-5)


def test_backend_resolution():
  assert attention.resolve_backend("auto", "cpu") == "xla"
  assert attention.resolve_backend("auto", "tpu") == "pallas"
  with pytest.raises(ValueError, match="pallas_interpret"):
    attention.resolve_backend("pallas", "cpu")
  assert jax.default_backend() == "cpu"


def as_pool(cache: KVCache, kind: str) -> KVCache:
  """The float32 cache stored as `kind` (bfloat16 as uint16 bits, int8 rows + scale)."""
  if kind == "bfloat16":
    def store(x):
      return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  elif kind == "int8":
    def store(x):
      return quantize_rows(x, "int8")
  else:
    return cache
  return KVCache(k=store(cache.k), v=store(cache.v), num_pages=cache.num_pages, dtype=kind)


def stored_keys(kv: KVCache, tables, lens):
  """Each sequence's (k, v) [n, K, H] as the pool holds them (dequantized), in order."""
  out = []
  for table, n in zip(tables, lens, strict=True):
    k, v = (from_storage(pool[jnp.asarray(table)], kv).astype(jnp.float32) for pool in (kv.k, kv.v))
    out.append(tuple(np.asarray(x).reshape(-1, *x.shape[2:])[:n] for x in (k, v)))
  return out


SINK_CASES = [  # kind, window, soft cap
  ("float32", None, None), ("float32", 5, 2.0), ("bfloat16", None, 3.0), ("int8", 6, None),
]


def _sink_case(kind, h=16, seed=20, width=8):
  rng = np.random.default_rng(seed)
  lens = [1, 9, 0, 21]  # a padding row (0 keys): zeros, with or without sinks
  cache, tables, _ = make_cache(rng, lens, 4, 2, h, 40, width)
  kv = as_pool(cache, kind)
  sinks = rng.normal(0.0, 2.0, 6).astype(np.float32)
  return kv, tables, lens, stored_keys(kv, tables, lens), jnp.asarray(sinks), rng


def engine_prefill(kv_lens, q_lens, tables, rows=128):
  """The engine's batched prefill inputs (packed rows, per-chunk query blocks) for chunks
  ending at kv_lens, of q_lens queries each, over `tables` -> (cu_q_lens, kv_lens, tables,
  blocks) as arrays. `tables` must be `BLOCKS_CONFIG.block_table_width` wide."""
  chunks = []
  for i, (n, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
    seq = Sequence(request_id=str(i), prompt_ids=list(range(n)), params=SamplingParams(),
                   pages=[int(p) for p in tables[i] if p], decode_slot=i)
    chunks.append(PrefillChunk(seq, n - ql, n, sample=False))
  inp, _ = build_prefill_input(chunks, BLOCKS_CONFIG, bucket=rows)
  return (jnp.asarray(inp.cu_q_lens), jnp.asarray(inp.kv_lens), jnp.asarray(inp.block_tables),
          jax.tree.map(jnp.asarray, inp.blocks))


BLOCKS_CONFIG = EngineConfig.of(page_size=4, max_model_len=128, attention_block_tokens=8,
                                max_num_batched_tokens=128, max_num_seqs=8)


def _tol(kind):
  return 2e-2 if kind == "bfloat16" else 2e-5  # bfloat16 pools: the dots run in bfloat16


@pytest.mark.parametrize("kind,window,cap", SINK_CASES)
@pytest.mark.parametrize("path", ["xla", "dispatch"])  # dispatch: the native kernel where built
def test_decode_and_verify_with_sinks(kind, window, cap, path):
  kv, tables, lens, dense, sinks, rng = _sink_case(kind)
  h, t = 16, 3
  q = rng.standard_normal((len(lens), t, 6, h)).astype(np.float32)
  q_lens = np.maximum(np.asarray(lens)[:, None] - np.arange(t)[::-1], 0).astype(np.int32)
  q_lens[2] = 0
  kw = dict(scale=h ** -0.5, sliding_window=window, soft_cap=cap, sinks=sinks)
  args = (kv, jnp.asarray(tables))
  if path == "xla":
    out, _ = attention.xla_multi_query_attention(jnp.asarray(q), *args, jnp.asarray(q_lens),
                                                 block_tokens=8, **kw)
    dec, _ = attention.xla_decode_attention(jnp.asarray(q[:, -1]), *args,
                                            jnp.asarray(lens, jnp.int32), block_tokens=8, **kw)
  else:
    out, _ = attention.verify_attention("xla", jnp.asarray(q), *args, jnp.asarray(q_lens),
                                        block_tokens=8, **kw)
    dec, _ = attention.decode_attention("xla", jnp.asarray(q[:, -1]), *args,
                                        jnp.asarray(lens, jnp.int32), block_tokens=8, **kw)
  out = np.asarray(out)
  assert not out[2].any() and not np.asarray(dec)[2].any()  # no keys: zeros
  for i, n in enumerate(lens):
    if n == 0:
      continue
    ref = dense_causal(q[i], *dense[i], q_lens[i] - 1, h ** -0.5, window, cap, sinks)
    np.testing.assert_allclose(out[i], ref, rtol=_tol(kind), atol=_tol(kind))
    np.testing.assert_allclose(np.asarray(dec)[i], ref[-1], rtol=_tol(kind), atol=_tol(kind))


@pytest.mark.parametrize("kind,window,cap", SINK_CASES)
@pytest.mark.parametrize("route,h", [("one", 16), ("blocks", 8), ("blocks", 16), ("general", 16)])
def test_prefill_with_sinks(kind, window, cap, route, h):
  """One sequence's chunk (blocked loop), the engine's batched chunks (per-chunk query
  blocks; with H = 16 the native kernel where built) and the general gather form."""
  kv, tables, lens, dense, sinks, rng = _sink_case(kind, h, 21, BLOCKS_CONFIG.block_table_width)
  q_lens = [1, 4, 0, 21]
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((128, 6, h)).astype(np.float32)
  kw = dict(scale=h ** -0.5, sliding_window=window, soft_cap=cap, sinks=sinks)
  if route == "one":  # the last sequence alone: its whole prompt as one chunk
    seqs, cu = [3], np.array([0, 0, 0, 0, 21])
    out, _ = attention.ragged_attention("xla", jnp.asarray(q[:24]), kv,
                                        jnp.asarray(tables[3:]), jnp.asarray([0, 21], jnp.int32),
                                        jnp.asarray([21], jnp.int32), block_tokens=8, **kw)
  elif route == "blocks":
    seqs = [0, 1, 3]
    cu_q, kv_lens, tbl, blocks = engine_prefill([1, 9, 21], [1, 4, 21], tables[[0, 1, 3]])
    out, _ = attention.ragged_attention("xla", jnp.asarray(q), kv, tbl, cu_q, kv_lens,
                                        blocks=blocks, block_tokens=8, **kw)
    cu = np.array([0, 1, 5, 5, 26])
  else:
    seqs = [0, 1, 3]
    out = attention.xla_ragged_attention(jnp.asarray(q[:cu[-1] + 3]), kv, jnp.asarray(tables),
                                         jnp.asarray(cu), jnp.asarray(lens, jnp.int32), **kw)
  for i in seqs:
    rows = slice(cu[i], cu[i + 1])
    ref = dense_causal(q[rows], *dense[i], lens[i] - q_lens[i] + np.arange(q_lens[i]),
                       h ** -0.5, window, cap, sinks)
    np.testing.assert_allclose(np.asarray(out[rows]), ref, rtol=_tol(kind), atol=_tol(kind))


@pytest.mark.parametrize("h", [8, 16])  # 16: the native kernel where built
def test_traced_window_per_layer(h):
  """Layers as a lax.scan, each with its own window from a layer-indexed array (0: full
  attention): decode and the engine's batched prefill inside one jit, each layer equal
  to dense attention with its window, with and without sinks."""
  rng = np.random.default_rng(22)
  lens, nk, g = [6, 13, 30], 2, 2
  cache, tables, dense = make_cache(rng, lens, 4, nk, h, 40, BLOCKS_CONFIG.block_table_width)
  windows = jnp.asarray([5, 0, 9], jnp.int32)
  q = rng.standard_normal((len(lens), nk * g, h)).astype(np.float32)
  qp = rng.standard_normal((128, nk * g, h)).astype(np.float32)
  q_lens = [2, 5, 9]
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu_q, kv_lens, tbl, blocks = engine_prefill(lens, q_lens, tables)

  @jax.jit
  def layers(windows, sinks):
    def layer(kv, w):
      kw = dict(scale=h ** -0.5, sliding_window=w, sinks=sinks, block_tokens=8)
      dec, kv = attention.decode_attention("xla", jnp.asarray(q), kv, jnp.asarray(tables),
                                           jnp.asarray(lens, jnp.int32), **kw)
      pre, kv = attention.ragged_attention("xla", jnp.asarray(qp), kv, tbl, cu_q, kv_lens,
                                           blocks=blocks, **kw)
      return kv, (dec, pre)
    return jax.lax.scan(layer, cache, windows)[1]

  for sinks in (None, jnp.asarray(rng.normal(0.0, 2.0, nk * g).astype(np.float32))):
    dec, pre = layers(windows, sinks)
    for layer, w in enumerate([5, None, 9]):
      for i, n in enumerate(lens):
        ref = dense_causal(q[i:i + 1], *dense[i], np.array([n - 1]), h ** -0.5, w, None, sinks)
        np.testing.assert_allclose(np.asarray(dec[layer, i:i + 1]), ref, rtol=2e-5, atol=2e-5)
        rows = slice(cu[i], cu[i + 1])
        ref = dense_causal(qp[rows], *dense[i], n - q_lens[i] + np.arange(q_lens[i]),
                           h ** -0.5, w, None, sinks)
        np.testing.assert_allclose(np.asarray(pre[layer, rows]), ref, rtol=2e-5, atol=2e-5)


def test_sinks_only_start_the_softmax():
  """Hand-worked: one key (score 0, value 4) and sink ln 3: p(key) = 1 / (1 + 3), so 1.0;
  with no key the output is 0."""
  k = jnp.zeros((2, 1, 1, 16), jnp.float32)
  v = jnp.full((2, 1, 1, 16), 4.0, jnp.float32)
  kv = KVCache(k=k, v=v, num_pages=2, dtype="float32")
  q = jnp.ones((2, 1, 16), jnp.float32)
  out, _ = attention.xla_decode_attention(q, kv, jnp.asarray([[1], [1]], jnp.int32),
                                          jnp.asarray([1, 0], jnp.int32), scale=1.0,
                                          sinks=jnp.asarray([np.log(3.0)], jnp.float32),
                                          block_tokens=1)
  np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [1.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_pallas_dispatch_passes_sinks_and_traced_window(kind):
  """backend "pallas_interpret" (the kernels in interpret mode): decode and ragged calls
  inside a jit with a traced window and sinks equal dense attention."""
  kv, tables, lens, dense, sinks, rng = _sink_case(kind, seed=23)
  h, q_lens = 16, [1, 4, 0, 21]
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((len(lens), 6, h)).astype(np.float32)
  qp = rng.standard_normal((32, 6, h)).astype(np.float32)

  @jax.jit
  def call(w):
    kw = dict(scale=h ** -0.5, sliding_window=w, soft_cap=3.0, sinks=sinks)
    dec, _ = attention.decode_attention("pallas_interpret", jnp.asarray(q), kv,
                                        jnp.asarray(tables), jnp.asarray(lens, jnp.int32), **kw)
    pre, _ = attention.ragged_attention("pallas_interpret", jnp.asarray(qp), kv,
                                        jnp.asarray(tables), jnp.asarray(cu),
                                        jnp.asarray(lens, jnp.int32), **kw)
    return dec, pre

  dec, pre = call(jnp.int32(6))
  assert not np.asarray(dec)[2].any()
  for i in (0, 1, 3):
    ref = dense_causal(q[i:i + 1], *dense[i], np.array([lens[i] - 1]), h ** -0.5, 6, 3.0, sinks)
    np.testing.assert_allclose(np.asarray(dec[i:i + 1]), ref, rtol=2e-5, atol=2e-5)
    rows = slice(cu[i], cu[i + 1])
    ref = dense_causal(qp[rows], *dense[i], lens[i] - q_lens[i] + np.arange(q_lens[i]),
                       h ** -0.5, 6, 3.0, sinks)
    np.testing.assert_allclose(np.asarray(pre[rows]), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("h", [8, 16])  # 16: the native kernel where built
def test_pages_behind_the_window_are_never_read(h):
  """The engine releases pages wholly behind a sliding window; the block table still
  names them and they may hold anything (NaN here). Decode, verification and the
  engine's batched prefill must not let them leak."""
  rng = np.random.default_rng(24)
  lens, q_lens, window = [30, 21, 9], [9, 5, 9], 6
  cache, tables, dense = make_cache(rng, lens, 4, 2, h, 40, BLOCKS_CONFIG.block_table_width)
  k, v = np.array(cache.k), np.array(cache.v)
  for i, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
    gone = max(n - ql - window + 1, 0) // 4  # pages behind the oldest new query's window
    k[tables[i, :gone]], v[tables[i, :gone]] = np.nan, np.nan
  kv = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), num_pages=40, dtype="float32")
  kw = dict(scale=h ** -0.5, sliding_window=window, block_tokens=8)
  t = 3  # verification: the last 3 positions of each row
  qv = rng.standard_normal((3, t, 4, h)).astype(np.float32)
  q_pos = np.asarray(lens)[:, None] - t + np.arange(t)
  out, _ = attention.verify_attention("xla", jnp.asarray(qv), kv, jnp.asarray(tables),
                                      jnp.asarray(q_pos + 1, jnp.int32), **kw)
  qp = rng.standard_normal((128, 4, h)).astype(np.float32)
  cu_q, kv_lens, tbl, blocks = engine_prefill(lens, q_lens, tables)
  pre, _ = attention.ragged_attention("xla", jnp.asarray(qp), kv, tbl, cu_q, kv_lens,
                                      blocks=blocks, **kw)
  cu = np.concatenate([[0], np.cumsum(q_lens)])
  for i, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
    ref = dense_causal(qv[i], *dense[i], q_pos[i], h ** -0.5, window)
    np.testing.assert_allclose(np.asarray(out[i]), ref, rtol=2e-5, atol=2e-5)
    rows = slice(cu[i], cu[i + 1])
    ref = dense_causal(qp[rows], *dense[i], n - ql + np.arange(ql), h ** -0.5, window)
    np.testing.assert_allclose(np.asarray(pre[rows]), ref, rtol=2e-5, atol=2e-5)
