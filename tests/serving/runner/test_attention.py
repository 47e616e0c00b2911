"""The XLA paged attention equals dense causal attention on ragged lengths.

Pages not owned by a sequence (and the padding page) are filled with NaN,
so any read outside a sequence's own keys shows up in the output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from serving.config import EngineConfig
from serving.runner import attention
from serving.runner.inputs import build_prefill_input
from serving.runner.kv_cache import KVCache
from serving.types import PrefillChunk, SamplingParams, Sequence


def dense_causal(q, k, v, q_pos, scale, window=None):
  """q [T, N, H] at positions q_pos; k, v [S, K, H] -> [T, N, H] (numpy, float64)."""
  g = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  s = np.einsum("tnh,snh->nts", q, k) * scale
  pos = np.arange(k.shape[0])
  mask = pos[None, :] <= q_pos[:, None]
  if window is not None:
    mask &= pos[None, :] > q_pos[:, None] - window
  s = np.where(mask[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nts,snh->tnh", p, v)


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
