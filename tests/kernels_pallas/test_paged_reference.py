"""The pure-jnp paged-attention references against hand-worked and dense cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import paged_decode_attention, ragged_paged_attention
from kernels_pallas.paged_attention import reference, testing

# Jitted once per shape: eager op-by-op dispatch would dominate these tests.
_OPTIONS = ("scale", "sliding_window", "soft_cap")
ref_paged_decode_attention = jax.jit(reference.ref_paged_decode_attention,
                                     static_argnames=_OPTIONS)
ref_ragged_paged_attention = jax.jit(reference.ref_ragged_paged_attention,
                                     static_argnames=_OPTIONS)


def _hand_pool():
  """Two keys on two shuffled pages (page_size 1): k = [0, ln 3], v = [4, 8]; H = 1."""
  nan = np.nan
  k = np.array([nan, math.log(3.0), 0.0, nan], np.float32).reshape(4, 1, 1, 1)
  v = np.array([nan, 8.0, 4.0, nan], np.float32).reshape(4, 1, 1, 1)
  tables = np.array([[2, 1, 3]], np.int32)  # third entry: a NaN page past the length
  return jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables)


@pytest.mark.parametrize(
  "seq_len, window, cap, expected",
  [
    (2, None, None, 7.0),  # softmax([0, ln 3]) = [1/4, 3/4]: 4/4 + 8*3/4
    (1, None, None, 4.0),  # only the first key
    (2, 1, None, 8.0),  # window 1: only the query's own position
    (0, None, None, 0.0),  # padding row
    (2, None, 0.5, None),  # soft cap, worked below
  ],
)
def test_decode_ref_hand_worked(seq_len, window, cap, expected):
  k, v, tables = _hand_pool()
  q = jnp.ones((1, 1, 1), jnp.float32)
  out = ref_paged_decode_attention(q, k, v, tables, jnp.array([seq_len], jnp.int32), scale=1.0,
                                   sliding_window=window, soft_cap=cap)
  if expected is None:
    capped = cap * math.tanh(math.log(3.0) / cap)
    expected = (4.0 + 8.0 * math.exp(capped)) / (1.0 + math.exp(capped))
  np.testing.assert_allclose(np.asarray(out).ravel(), [expected], rtol=1e-5)


@pytest.mark.parametrize(
  "seq_len, window, sink, expected",
  [
    (2, None, math.log(4.0), 3.5),  # weights 1, 3 and the sink's 4: (4 + 8 * 3) / 8
    (1, None, 0.0, 2.0),  # one key (weight 1) and the sink (1): 4 / 2
    (0, None, 5.0, 0.0),  # padding row: zeros, sink or not
    (2, 1, math.log(3.0), 4.0),  # window 1: key ln 3 (weight 3) and the sink (3): 8 * 3 / 6
  ],
)
def test_decode_ref_sinks_hand_worked(seq_len, window, sink, expected):
  """GPT-OSS sinks: one more softmax term per head, contributing no value."""
  k, v, tables = _hand_pool()
  out = ref_paged_decode_attention(jnp.ones((1, 1, 1), jnp.float32), k, v, tables,
                                   jnp.array([seq_len], jnp.int32), scale=1.0,
                                   sliding_window=window, sinks=jnp.array([sink], jnp.float32))
  np.testing.assert_allclose(np.asarray(out).ravel(), [expected], rtol=1e-5)


@pytest.mark.parametrize("window, expected", [(1, 8.0), (2, 7.0), (0, 7.0), (-3, 7.0)])
def test_ref_traced_window_hand_worked(window, expected):
  """A traced window (jit argument) masks like the static one; <= 0 means none."""
  k, v, tables = _hand_pool()
  q = jnp.ones((1, 1, 1), jnp.float32)
  out = jax.jit(lambda w: paged_decode_attention(q, k, v, tables, jnp.array([2], jnp.int32),
                                                 scale=1.0, sliding_window=w))(jnp.int32(window))
  np.testing.assert_allclose(np.asarray(out).ravel(), [expected], rtol=1e-5)


def test_ragged_ref_hand_worked():
  """Two queries of one sequence (kv_len 2) plus a padding row."""
  k, v, tables = _hand_pool()
  q = jnp.asarray(np.array([1.0, 1.0, np.nan], np.float32).reshape(3, 1, 1))
  out = ref_ragged_paged_attention(q, k, v, tables, jnp.array([0, 2], jnp.int32),
                                   jnp.array([2], jnp.int32), scale=1.0)
  np.testing.assert_allclose(np.asarray(out).ravel(), [4.0, 7.0, 0.0], rtol=1e-5)


def _dense_causal(q, k, v, scale, window=None, cap=None, sinks=None):
  """float64 dense attention. q [L, N, H]; k, v [L, K, H]; query i at position i;
  sinks [N]: one more softmax column per head (transformers' GPT-OSS), then dropped."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  length, num_q_heads, _ = q.shape
  group = num_q_heads // k.shape[1]
  k = np.repeat(k, group, axis=1)
  v = np.repeat(v, group, axis=1)
  logits = np.einsum("inh,jnh->nij", q, k) * scale
  if cap is not None:
    logits = cap * np.tanh(logits / cap)
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  mask = j <= i
  if window is not None:
    mask &= i - j < window
  logits = np.where(mask, logits, -np.inf)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (*logits.shape[:2], 1))
    logits = np.concatenate([logits, sink], axis=-1)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nij,jnh->inh", p[..., :length], v)


def _contiguous_kv(inputs, seq, length):
  """Keys and values of sequence ``seq`` read back in position order: [length, K, H]."""
  page_size = inputs.k_pages.shape[1]
  pages = np.asarray(inputs.block_tables[seq, : -(-length // page_size)])
  k = np.asarray(inputs.k_pages[pages], np.float32).reshape(-1, *inputs.k_pages.shape[2:])
  v = np.asarray(inputs.v_pages[pages], np.float32).reshape(-1, *inputs.v_pages.shape[2:])
  return k[:length], v[:length]


@pytest.mark.parametrize("window, cap, sinks", [(None, None, False), (5, None, False),
                                                (None, 2.0, False), (5, 2.0, True),
                                                (None, None, True)])
def test_refs_match_dense_causal(window, cap, sinks):
  """Every prefix's decode output and a chunked-prefill ragged call equal dense attention."""
  length, group, head_dim = 13, 3, 8
  inputs = testing.make_ragged_inputs(0, [length], [length], num_tokens=length, page_size=4,
                                      num_kv_heads=2, group=group, head_dim=head_dim,
                                      dtype=jnp.float32)
  k, v = _contiguous_kv(inputs, 0, length)
  scale = head_dim**-0.5
  sinks = jnp.asarray([1.5, -0.5, 0.0, 2.0, -3.0, 0.7], jnp.float32) if sinks else None
  dense = _dense_causal(inputs.q, k, v, scale, window, cap, sinks)
  opts = dict(scale=scale, sliding_window=window, soft_cap=cap, sinks=sinks)

  full = ref_ragged_paged_attention(inputs.q, inputs.k_pages, inputs.v_pages,
                                    inputs.block_tables, inputs.cu_q_lens, inputs.lens, **opts)
  np.testing.assert_allclose(full, dense, atol=1e-5, rtol=1e-5)

  # Chunked prefill: the last 4 queries against all 13 keys, then 9 padding rows.
  q_tail = jnp.concatenate([inputs.q[-4:], jnp.full((9, *inputs.q.shape[1:]), jnp.nan)])
  tail = ref_ragged_paged_attention(q_tail, inputs.k_pages, inputs.v_pages, inputs.block_tables,
                                    jnp.array([0, 4], jnp.int32), inputs.lens, **opts)
  np.testing.assert_allclose(tail[:4], dense[-4:], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(tail[4:], 0.0)

  # Decode: query i attends to the first i + 1 keys.
  lens = jnp.arange(1, length + 1, dtype=jnp.int32)
  tables = jnp.repeat(inputs.block_tables, length, axis=0)
  dec = ref_paged_decode_attention(inputs.q, inputs.k_pages, inputs.v_pages, tables, lens, **opts)
  np.testing.assert_allclose(dec, dense, atol=1e-5, rtol=1e-5)


def test_ragged_ref_several_sequences_match_decode():
  """Each ragged row equals a decode call at the same position over the same pages."""
  q_lens, kv_lens = [3, 1, 0, 5], [7, 16, 4, 5]
  inputs = testing.make_ragged_inputs(1, q_lens, kv_lens, num_tokens=12, page_size=4,
                                      num_kv_heads=1, group=4, head_dim=8, dtype=jnp.float32)
  out = ref_ragged_paged_attention(inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables,
                                   inputs.cu_q_lens, inputs.lens, scale=0.3)
  seq = np.repeat(np.arange(4), q_lens)
  pos = np.concatenate([np.arange(kl - ql, kl) for ql, kl in zip(q_lens, kv_lens, strict=True)])
  dec = ref_paged_decode_attention(inputs.q[:9], inputs.k_pages, inputs.v_pages,
                                   inputs.block_tables[seq], jnp.asarray(pos + 1, jnp.int32),
                                   scale=0.3)
  np.testing.assert_allclose(out[:9], dec, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(out[9:], 0.0)
  assert np.isfinite(np.asarray(out)).all()


def test_public_api_ref_impl_and_bf16():
  inputs = testing.make_decode_inputs(2, [5, 0, 16], page_size=4, num_kv_heads=2, group=2,
                                      head_dim=8, dtype=jnp.bfloat16)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.lens)
  out = paged_decode_attention(*args, scale=0.5)
  assert out.dtype == jnp.bfloat16 and out.shape == inputs.q.shape
  f32 = ref_paged_decode_attention(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in args), scale=0.5)
  np.testing.assert_allclose(np.asarray(out, np.float32), f32, atol=2e-2, rtol=2e-2)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)


def _decode_args(**overrides):
  inputs = testing.make_decode_inputs(0, [3, 4], page_size=4, num_kv_heads=2, group=2,
                                      head_dim=8, dtype=jnp.float32)
  args = dict(q=inputs.q, k_pages=inputs.k_pages, v_pages=inputs.v_pages,
              block_tables=inputs.block_tables, seq_lens=inputs.lens)
  args.update(overrides)
  return args


@pytest.mark.parametrize(
  "overrides, error, match",
  [
    (dict(q=jnp.zeros((2, 4, 16))), ValueError, "head_dim"),
    (dict(q=jnp.zeros((2, 3, 8))), ValueError, "multiple of kv heads"),
    (dict(q=jnp.zeros((2, 4, 8), jnp.float16)), TypeError, "float32 or bfloat16"),
    (dict(k_pages=jnp.zeros((5, 4, 2, 8), jnp.float16)), TypeError, "k_pages dtype"),
    (dict(v_pages=jnp.zeros((5, 4, 2, 8), jnp.bfloat16)), TypeError, "v_pages dtype"),
    (dict(v_pages=jnp.zeros((9, 4, 2, 4))), ValueError, "v_pages shape"),
    (dict(block_tables=jnp.zeros((2, 2), jnp.float32)), TypeError, "block_tables"),
    (dict(block_tables=jnp.zeros((3, 2), jnp.int32)), ValueError, "block_tables"),
    (dict(seq_lens=jnp.zeros((2,), jnp.int16)), TypeError, "seq_lens"),
    (dict(seq_lens=jnp.zeros((3,), jnp.int32)), ValueError, "seq_lens"),
  ],
)
def test_decode_validation(overrides, error, match):
  with pytest.raises(error, match=match):
    paged_decode_attention(**_decode_args(**overrides), scale=1.0)


@pytest.mark.parametrize(
  "options, match",
  [
    (dict(impl="cuda"), "impl"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
    (dict(scale=0.0), "scale"),
    (dict(sliding_window=jnp.float32(4.0)), "traced sliding_window must be one integer"),
    (dict(sliding_window=jnp.ones((2,), jnp.int32)), "traced sliding_window"),
    (dict(sinks=jnp.zeros((2,), jnp.float32)), r"sinks must have shape \(4,\)"),
  ],
)
def test_option_validation(options, match):
  options = {"scale": 1.0, **options}
  with pytest.raises(ValueError, match=match):
    paged_decode_attention(**_decode_args(), **options)


def test_sinks_dtype_validation():
  with pytest.raises(TypeError, match="sinks must be a float"):
    paged_decode_attention(**_decode_args(), scale=1.0, sinks=jnp.zeros((4,), jnp.int32))


def test_ragged_validation():
  inputs = testing.make_ragged_inputs(0, [2], [3], num_tokens=4, page_size=4, num_kv_heads=1,
                                      group=1, head_dim=8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="cu_q_lens"):
    ragged_paged_attention(inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables,
                           jnp.array([0, 1, 2], jnp.int32), inputs.lens, scale=1.0)


def test_compiled_kernel_off_its_platform_is_a_clear_error():
  other = "gpu" if jax.default_backend() == "tpu" else "tpu"
  with pytest.raises(ValueError, match="backend"):
    paged_decode_attention(**_decode_args(), scale=1.0, impl=other)
