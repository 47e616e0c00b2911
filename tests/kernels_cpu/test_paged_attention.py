"""The native paged attention (kernels_cpu) against a dense jnp reference and the XLA path.

The reference gathers each row's keys from its block table and runs a plain
masked softmax; the kernel must match it for every pool kind it reads
(float32, bfloat16 as uint16, int8 rows with a scale), one and several
queries per row, rows that see no key, a sliding window (static or traced)
and a soft cap, per-head attention sinks, and block tables whose unused
entries point anywhere in the pool. The serving
dispatch (`serving.runner.attention`) must route decode and verification
through it and agree with its own XLA loop. The AVX2 kernel (attention_avx2.h, forced
with `XLASERVE_NATIVE_ISA=avx2`) must match the same reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import paged_attention as native
from serving.runner import attention
from serving.runner.kv_cache import KVCache, from_storage, quantize_rows

needs_native = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason="native kernels not built or CPU lacks AVX-512")

PAGES, PS, K, H, N, W = 24, 4, 2, 32, 6, 6


def _pool(kind: str, seed: int) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  k, v = (rng.standard_normal((PAGES, PS, K, H)).astype(np.float32) for _ in range(2))
  if kind == "bfloat16":
    def store(x):
      return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16)
  elif kind == "int8":
    def store(x):
      return quantize_rows(jnp.asarray(x), "int8")
  else:
    store = jnp.asarray
  return store(k), store(v)


def _reference(q, k_pages, v_pages, tables, q_lens, kind, scale, window=None, soft_cap=None,
               sinks=None):
  """Dense: gather [B, W*ps, K, H], mask, softmax (with each head's sink logit as one more
  column, whose probability is then dropped); float32 throughout."""
  kv = KVCache(k=k_pages, v=v_pages, num_pages=PAGES, dtype=kind)
  k = from_storage(k_pages[tables], kv).astype(jnp.float32).reshape(tables.shape[0], -1, K, H)
  v = from_storage(v_pages[tables], kv).astype(jnp.float32).reshape(tables.shape[0], -1, K, H)
  b, t, n, _ = q.shape
  qg = q.reshape(b, t, K, n // K, H)
  s = jnp.einsum("btkgh,bskh->btkgs", qg, k, precision="highest") * scale
  if soft_cap:
    s = soft_cap * jnp.tanh(s / soft_cap)
  pos = jnp.arange(k.shape[1])
  valid = pos[None, None, :] < q_lens[:, :, None]  # [B, T, S]
  if window:
    valid &= pos[None, None, :] >= q_lens[:, :, None] - window
  valid = valid[:, :, None, None, :]
  s = jnp.where(valid, s, -1e30)
  if sinks is not None:  # [N] -> [B, T, K, G, 1], one more column
    sink = jnp.broadcast_to(sinks.reshape(K, n // K, 1), (*s.shape[:-1], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
  else:
    p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(valid, p, 0.0)
  out = jnp.einsum("btkgs,bskh->btkgh", p, v, precision="highest")
  return out.reshape(b, t, n, H)


def _case(b, t, seed):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, N, H)).astype(np.float32))
  tables = jnp.asarray(rng.integers(0, PAGES, (b, W)).astype(np.int32))
  q_lens = rng.integers(0, W * PS + 1, (b, t)).astype(np.int32)
  q_lens[0, 0] = 0  # a row that sees nothing
  q_lens[-1, -1] = W * PS  # one that sees every key
  return q, tables, jnp.asarray(q_lens)


@needs_native
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("b,t", [(1, 1), (5, 1), (3, 4)])
def test_matches_reference(kind, b, t):
  k_pages, v_pages = _pool(kind, seed=b * 10 + t)
  q, tables, q_lens = _case(b, t, seed=b + t)
  got = jax.jit(lambda *a: native.paged_attention(*a, kv_dtype=kind, scale=0.2))(
      q, k_pages, v_pages, tables, q_lens)
  want = _reference(q, k_pages, v_pages, tables, q_lens, kind, 0.2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  if b * t > 1:
    assert not np.asarray(got)[0, 0].any()  # no keys: zeros, as the XLA path


@needs_native
@pytest.mark.parametrize("window,soft_cap", [(5, None), (None, 3.0), (7, 2.0)])
def test_window_and_soft_cap(window, soft_cap):
  k_pages, v_pages = _pool("float32", seed=3)
  q, tables, q_lens = _case(4, 2, seed=4)
  got = native.paged_attention(q, k_pages, v_pages, tables, q_lens, kv_dtype="float32",
                               scale=0.3, sliding_window=window, soft_cap=soft_cap)
  want = _reference(q, k_pages, v_pages, tables, q_lens, "float32", 0.3, window, soft_cap)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@needs_native
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (7, 2.0)])
def test_sinks(kind, window, soft_cap):
  """GPT-OSS sinks: one more logit per head in the softmax, no value; a row with no
  key gives zeros."""
  k_pages, v_pages = _pool(kind, seed=9)
  q, tables, q_lens = _case(3, 2, seed=10)
  sinks = jnp.asarray(np.random.default_rng(11).normal(0, 2, N).astype(np.float32))
  got = native.paged_attention(q, k_pages, v_pages, tables, q_lens, kv_dtype=kind, scale=0.3,
                               sliding_window=window, soft_cap=soft_cap, sinks=sinks)
  want = _reference(q, k_pages, v_pages, tables, q_lens, kind, 0.3, window, soft_cap, sinks)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  assert not np.asarray(got)[0, 0].any()
  plain = _reference(q, k_pages, v_pages, tables, q_lens, kind, 0.3, window, soft_cap)
  assert not np.allclose(np.asarray(got)[1:], np.asarray(plain)[1:], atol=1e-3)


@needs_native
def test_traced_window_per_layer():
  """A scanned layer stack passes its layer's window traced: 0 means no window."""
  k_pages, v_pages = _pool("float32", seed=12)
  q, tables, q_lens = _case(4, 2, seed=13)
  windows = jnp.asarray([5, 0, 9], jnp.int32)

  def step(_, w):
    return None, native.paged_attention(q, k_pages, v_pages, tables, q_lens,
                                        kv_dtype="float32", scale=0.3, sliding_window=w)

  _, got = jax.jit(lambda w: jax.lax.scan(step, None, w))(windows)
  for i, w in enumerate([5, None, 9]):
    want = _reference(q, k_pages, v_pages, tables, q_lens, "float32", 0.3, w)
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=2e-5, atol=2e-5)


@needs_native
def test_page_outside_the_pool_is_refused():
  """A corrupt block table fails the call instead of reading outside the pool."""
  k_pages, v_pages = _pool("float32", seed=5)
  q, tables, q_lens = _case(2, 1, seed=6)
  with pytest.raises(Exception, match="outside the pool"):
    np.asarray(native.paged_attention(q, k_pages, v_pages, tables.at[1, 2].set(PAGES), q_lens,
                                      kv_dtype="float32", scale=0.1))


@needs_native
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_serving_dispatch_agrees_with_xla_loop(kind):
  """decode_attention / verify_attention take the kernel, and match the XLA loop."""
  k_pages, v_pages = _pool(kind, seed=7)
  kv = KVCache(k=k_pages, v=v_pages, num_pages=PAGES, dtype=kind)
  q, tables, q_lens = _case(3, 3, seed=8)
  fn = jax.jit(lambda q, kv, tb, ql: attention.verify_attention("xla", q, kv, tb, ql, scale=0.2,
                                                                block_tokens=8)[0])
  assert "xlaserve_paged_attention" in str(jax.make_jaxpr(fn)(q, kv, tables, q_lens))
  got = fn(q, kv, tables, q_lens)
  want, _ = attention.xla_multi_query_attention(q, kv, tables, q_lens, scale=0.2, block_tokens=8)
  tol = 2e-2 if kind == "bfloat16" else 2e-5  # the XLA loop's dots run in bfloat16 there
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
  seq_lens = q_lens[:, 0]
  got, _ = attention.decode_attention("xla", q[:, 0], kv, tables, seq_lens, scale=0.2)
  want, _ = attention.xla_decode_attention(q[:, 0], kv, tables, seq_lens, scale=0.2,
                                           block_tokens=8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_rows_sharing_a_table_match_each_row_alone_bitwise(kind):
  """Packed prefill rows (one-query rows, three chunks' tables, each repeated over its
  rows, 37 rows so spans are cut) attend a span at a time; every row's output is bitwise
  the same row attended alone, and matches the reference."""
  k_pages, v_pages = _pool(kind, seed=11)
  rng = np.random.default_rng(12)
  chunk_rows = (20, 1, 16)
  chunk_tables = rng.integers(0, PAGES, (len(chunk_rows), W)).astype(np.int32)
  tables = np.repeat(chunk_tables, chunk_rows, axis=0)
  q_lens = np.concatenate([np.arange(W * PS - n + 1, W * PS + 1) for n in chunk_rows])
  q_lens[3] = 0  # a padding-like row that sees nothing
  q = jnp.asarray(rng.standard_normal((len(tables), 1, N, H)).astype(np.float32))
  tables, q_lens = jnp.asarray(tables), jnp.asarray(q_lens[:, None].astype(np.int32))
  got = native.paged_attention(q, k_pages, v_pages, tables, q_lens, kv_dtype=kind, scale=0.2)
  want = _reference(q, k_pages, v_pages, tables, q_lens, kind, 0.2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  for i in range(len(tables)):
    alone = native.paged_attention(q[i:i + 1], k_pages, v_pages, tables[i:i + 1],
                                   q_lens[i:i + 1], kv_dtype=kind, scale=0.2)
    np.testing.assert_array_equal(np.asarray(got[i:i + 1]), np.asarray(alone))


def test_supports():
  kv = jnp.zeros((4, 4, 2, 32), jnp.float32)
  assert native.supports((1, 1, 6, 32), kv, "float32")
  assert not native.supports((1, 1, 6, 32), kv, "bfloat16")  # stored dtype differs
  assert not native.supports((1, 1, 6, 32), kv, "fp8")  # no fp8 pages
  assert not native.supports((1, 64, 6, 32), kv, "float32")  # a prefill chunk
  assert not native.supports((1, 1, 5, 32), kv, "float32")  # heads not a multiple of K
  assert not native.supports((1, 1, 6, 24), jnp.zeros((4, 4, 2, 24)), "float32")  # H % 16
  assert native.supports((2, 1, 6, 32), jnp.zeros((4, 4, 2, 36), jnp.uint8), "int8")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("b,t", [(1, 1), (3, 4)])
def test_avx2_matches_reference(force_avx2, kind, b, t):
  """Keys in blocks of 8 (partial blocks: q_lens are random), every pool kind."""
  k_pages, v_pages = _pool(kind, seed=b * 10 + t)
  q, tables, q_lens = _case(b, t, seed=b + t)
  fn = lambda *a: native.paged_attention(*a, kv_dtype=kind, scale=0.2)  # noqa: E731
  assert "xlaserve_paged_attention_avx2" in str(jax.make_jaxpr(fn)(q, k_pages, v_pages, tables,
                                                                   q_lens))
  got = jax.jit(fn)(q, k_pages, v_pages, tables, q_lens)
  want = _reference(q, k_pages, v_pages, tables, q_lens, kind, 0.2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  if b * t > 1:
    assert not np.asarray(got)[0, 0].any()


@pytest.mark.parametrize("window,soft_cap,with_sinks", [(5, None, False), (7, 2.0, True)])
def test_avx2_window_soft_cap_sinks(force_avx2, window, soft_cap, with_sinks):
  k_pages, v_pages = _pool("bfloat16", seed=9)
  q, tables, q_lens = _case(3, 2, seed=10)
  sinks = (jnp.asarray(np.random.default_rng(11).normal(0, 2, N).astype(np.float32))
           if with_sinks else None)
  got = native.paged_attention(q, k_pages, v_pages, tables, q_lens, kv_dtype="bfloat16",
                               scale=0.3, sliding_window=window, soft_cap=soft_cap, sinks=sinks)
  want = _reference(q, k_pages, v_pages, tables, q_lens, "bfloat16", 0.3, window, soft_cap,
                    sinks)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
