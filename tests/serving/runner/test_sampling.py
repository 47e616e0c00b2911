"""Tests of serving/runner/sampling/ against a row-by-row numpy reference with vLLM semantics.

The reference draws by inverse CDF in vocabulary order with the same uniform
`jax.random.uniform(fold_in(key(seed), step))` that the contract prescribes, so
sampled tokens are compared exactly, not only in distribution.
"""

import zlib

import jax
import numpy as np
import pytest
from sampling_ref import (
  chi_square,
  ref_filtered,
  ref_log_softmax,
  ref_penalise,
  ref_token,
  softmax,
)

from serving.runner.sampling import SamplingTensors, reductions, sample, thresholds
from serving.types import MAX_LOGPROBS, SamplingParams

B, V = 16, 1000  # the shape most tests share, so `_sample` compiles once
_sample = jax.jit(sample)
# Rows gathered from [2B, V] slot state; used at batch 8 only (a second batch size).
_sample_rows = jax.jit(lambda *args, rows: sample(*args, rows=rows))

def test_reference_hand_cases():
  neutral = dict(prompt=np.zeros(4, bool), counts=np.zeros(4, np.int32))
  x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  keep = lambda **kw: np.isfinite(ref_filtered(x, SamplingParams(**kw), **neutral))
  np.testing.assert_array_equal(keep(top_k=2), [1, 1, 0, 0])
  np.testing.assert_array_equal(keep(top_p=0.45), [1, 0, 0, 0])
  np.testing.assert_array_equal(keep(top_p=0.6), [1, 1, 0, 0])
  np.testing.assert_array_equal(keep(top_p=0.85), [1, 1, 1, 0])
  np.testing.assert_array_equal(keep(min_p=0.5), [1, 1, 0, 0])
  np.testing.assert_array_equal(keep(top_k=3, min_p=0.4), [1, 1, 0, 0])
  y = np.array([2.0, -2.0, 2.0, 1.0], np.float32)
  counts = np.array([0, 0, 2, 1], np.int32)
  pen = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
  np.testing.assert_allclose(
      ref_penalise(y, pen, np.array([1, 1, 0, 0], bool), counts), [1.0, -4.0, -0.25, -0.25])
  assert ref_token(y, None, np.zeros(4, bool), counts, 0, 0) == 0


# ---------------------------------------------------------------------------
# Helpers.


def make_logits(rng, b=B, v=V, scale=3.0):
  return (rng.standard_normal((b, v)) * scale).astype(np.float32)


def make_state(rng, b=B, v=V):
  prompt = rng.random((b, v)) < 0.05
  counts = rng.poisson(0.05, (b, v)).astype(np.int32)
  return prompt, counts


def run(logits, params, prompt, counts, seeds=None, steps=None):
  b = logits.shape[0]
  seeds = list(range(100, 100 + len(params))) if seeds is None else seeds
  steps = [0] * len(params) if steps is None else steps
  t = SamplingTensors.build(params, seeds, steps, b)
  return _sample(logits, t, prompt, counts), seeds, steps


def check_against_reference(logits, params, prompt, counts, seeds=None, steps=None):
  out, seeds, steps = run(logits, params, prompt, counts, seeds, steps)
  tokens = np.asarray(out.tokens)
  want = [ref_token(logits[i], p, prompt[i], counts[i], seeds[i], steps[i])
          for i, p in enumerate(params)]
  np.testing.assert_array_equal(tokens[:len(params)], want)
  return out


# ---------------------------------------------------------------------------
# Sampling against the reference.


def test_greedy_is_argmax_and_logprobs_are_raw():
  rng = np.random.default_rng(0)
  logits = make_logits(rng)
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  out = check_against_reference(logits, [SamplingParams(temperature=0.0, logprobs=5)] * B, *zero)
  np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))
  lsm = np.stack([ref_log_softmax(r) for r in logits])
  np.testing.assert_allclose(out.logprob, lsm[np.arange(B), out.tokens], atol=1e-5)


CASES = {
  "temperature": dict(temperature=0.7),
  "hot": dict(temperature=1.5),
  "top_k": dict(top_k=5),
  "top_k_1": dict(top_k=1, temperature=2.0),
  "top_p": dict(top_p=0.8),
  "min_p": dict(min_p=0.1, temperature=1.3),
  "top_k_top_p_min_p": dict(top_k=50, top_p=0.9, min_p=0.05, temperature=0.9),
  "repetition": dict(repetition_penalty=1.7),
  "repetition_greedy": dict(repetition_penalty=0.6, temperature=0.0),
  "tiny_temperature_is_greedy": dict(temperature=1e-6, top_p=0.5),
  "presence": dict(presence_penalty=1.5),
  "frequency": dict(frequency_penalty=-1.2, temperature=0.0),
  "all_penalties": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                        top_p=0.95),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  logits = make_logits(rng)
  prompt, counts = make_state(rng)
  params = [SamplingParams(**CASES[name])] * B
  for step in range(3):
    check_against_reference(logits, params, prompt, counts, steps=[step] * B)


def test_mixed_batch_matches_reference():
  rng = np.random.default_rng(1)
  logits = make_logits(rng)
  prompt, counts = make_state(rng)
  kinds = list(CASES.values()) + [dict(temperature=0.0), dict(logprobs=3)]
  params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(B - 2)] + [None]
  for step in range(4):
    check_against_reference(logits, params, prompt, counts, steps=[step] * len(params))


def test_small_top_k_batch_matches_reference():
  """Top-k rows (all k <= 64), greedy and plain rows, no top-p: the narrow top-k branch."""
  rng = np.random.default_rng(16)
  logits = make_logits(rng, scale=1.0)
  prompt, counts = make_state(rng)
  kinds = [dict(top_k=64), dict(top_k=1), dict(temperature=0.0), dict(top_k=20, min_p=0.1),
           dict(temperature=0.8), dict(top_k=40, presence_penalty=0.5)]
  params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(B)]
  check_against_reference(logits, params, prompt, counts, steps=list(range(B)))


def random_params(rng):
  """Random SamplingParams touching every stage (and the search) with fair probability."""
  pick = lambda prob, value, default: value if rng.random() < prob else default
  return SamplingParams(
      temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.6])),
      top_k=pick(0.4, int(rng.choice([1, 2, 7, 40, 256, 300, 999, 2000])), -1),
      top_p=pick(0.5, float(rng.uniform(0.05, 1.0)), 1.0),
      min_p=pick(0.3, float(rng.uniform(0.0, 0.5)), 0.0),
      repetition_penalty=pick(0.3, float(rng.uniform(0.5, 2.0)), 1.0),
      presence_penalty=pick(0.3, float(rng.uniform(-2, 2)), 0.0),
      frequency_penalty=pick(0.3, float(rng.uniform(-2, 2)), 0.0),
      logprobs=pick(0.3, int(rng.integers(0, 21)), None))


def test_random_batches_match_reference():
  """Seeded fuzz: random per-row parameters and logit scales against the reference."""
  rng = np.random.default_rng(15)
  for _ in range(12):
    logits = make_logits(rng) * rng.choice([0.05, 0.3, 1.0, 3.0], size=(B, 1)).astype(np.float32)
    prompt, counts = make_state(rng)
    n = int(rng.integers(1, B + 1))
    params = [random_params(rng) if rng.random() < 0.9 else None for _ in range(n)]
    seeds = [int(x) for x in rng.integers(0, 2**31, n)]
    steps = [int(x) for x in rng.integers(0, 1000, n)]
    check_against_reference(logits, params, prompt, counts, seeds, steps)


@pytest.mark.parametrize("n_wide", [1, 3, 11])
@pytest.mark.parametrize("kw", [dict(top_p=0.9, temperature=1.0), dict(top_k=300),
                                dict(top_k=400, top_p=0.7), dict(top_k=700, min_p=0.02)])
def test_search_fallback_matches_reference(kw, n_wide):
  """Flat logits (a nucleus wider than TOP_K_CAP) and top_k > TOP_K_CAP take the search,
  for a few rows (one chunk), several chunks, and most of the batch."""
  assert thresholds.TOP_K_CAP < 300 and thresholds.SEARCH_CHUNK < 11
  rng = np.random.default_rng(2)
  logits = make_logits(rng, scale=0.5)
  prompt, counts = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  params = [SamplingParams(top_k=3, top_p=0.9)] * B
  for i in rng.permutation(B)[:n_wide]:
    params[i] = SamplingParams(**kw)
  check_against_reference(logits, params, prompt, counts)


def test_search_thresholds_match_reference():
  """The search alone (no fast path) finds the smallest kept logit of the reference."""
  rng = np.random.default_rng(3)
  z = make_logits(rng) * rng.choice([0.1, 1.0, 3.0], size=(B, 1)).astype(np.float32)
  k = rng.integers(1, 2 * thresholds.TOP_K_CAP, B).astype(np.int32)
  k[::3] = V  # top-p only
  p = rng.uniform(0.05, 1.0, B).astype(np.float32)
  p[1::3] = 1.0  # top-k only
  thr = jax.jit(thresholds.search_thresholds)(z, z.max(-1), k, p, np.full(B, -np.inf, np.float32),
                                             np.zeros(B, bool))
  neutral = np.zeros(V, bool), np.zeros(V, np.int32)
  for i in range(B):
    params = SamplingParams(top_k=int(k[i]) % V, top_p=float(p[i]))
    kept = z[i][np.isfinite(ref_filtered(z[i], params, *neutral))]
    assert thr[i] == kept.min(), (i, k[i], p[i])


def test_large_vocab():
  """The real vocabulary size: fast path, fallback and greedy rows in one batch."""
  rng = np.random.default_rng(4)
  b, v = 4, 49152
  logits = make_logits(rng, b, v)
  logits[1] *= 0.1  # flat: its nucleus needs the search
  prompt, counts = make_state(rng, b, v)
  params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.95, top_k=1000),
            SamplingParams(temperature=0.0, repetition_penalty=1.2),
            SamplingParams(min_p=0.05, presence_penalty=0.3)]
  check_against_reference(logits, params, prompt, counts, steps=[5] * b)


# ---------------------------------------------------------------------------
# Determinism, statistics, logprobs, padding, compilation.


def test_seed_determinism_across_rows_and_batches():
  rng = np.random.default_rng(5)
  row = make_logits(rng, 1, V, scale=1.0)[0]
  params = SamplingParams(temperature=1.0, top_p=0.95)
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  got = []
  for position, seed_offset in [(0, 0), (7, 1000), (B - 1, 77)]:
    logits = make_logits(rng, scale=1.0)
    logits[position] = row
    seeds = [seed_offset + i for i in range(B)]
    seeds[position] = 42
    steps = [9] * B
    plist = [SamplingParams(temperature=0.5 + 0.1 * i) for i in range(B)]
    plist[position] = params
    out, _, _ = run(logits, plist, *zero, seeds, steps)
    got.append(int(out.tokens[position]))
  small = np.concatenate([make_logits(rng, 7, V), row[None]])
  t = SamplingTensors.build([None] * 7 + [params], [0] * 7 + [42], [9] * 8, 8)
  slot_state = np.zeros((2 * B, V), bool), np.zeros((2 * B, V), np.int32)
  out = _sample_rows(small, t, *slot_state, rows=np.arange(8, dtype=np.int32))
  got.append(int(out.tokens[7]))
  assert len(set(got)) == 1, got
  many, _, _ = run(np.repeat(row[None], B, 0), [params] * B, *zero, list(range(B)), [9] * B)
  assert len(set(np.asarray(many.tokens).tolist())) > B // 2  # different seeds differ


def test_row_threshold_ignores_neighbours():
  """A row that fits the fast path samples the same whether or not neighbours need the search."""
  rng = np.random.default_rng(12)
  logits = make_logits(rng)  # peaked: a top_p=0.9 nucleus fits TOP_K_CAP
  prompt, counts = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  params = [SamplingParams(top_p=0.9)] * B
  seeds, steps = list(range(B)), list(range(B))
  alone, _, _ = run(logits, params, prompt, counts, seeds, steps)
  wide = logits.copy()
  wide[B - 1] *= 0.05  # its nucleus does not fit: the search runs on a chunk with rows 0..2
  mixed, _, _ = run(wide, params, prompt, counts, seeds, steps)
  np.testing.assert_array_equal(alone.tokens[:B - 1], mixed.tokens[:B - 1])


def test_rows_gather_slot_state():
  """sample(..., rows=) on [S, V] slot state equals sampling the gathered rows."""
  rng = np.random.default_rng(13)
  logits = make_logits(rng, 8)
  slot_prompt, slot_counts = make_state(rng, 2 * B)
  rows = rng.permutation(2 * B)[:8].astype(np.int32)
  params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, top_k=10)] * 8
  gathered = _sample_rows(logits, SamplingTensors.build(params, list(range(8)), [0] * 8, 8),
                          slot_prompt, slot_counts, rows=rows)
  pad = lambda a: np.concatenate([a, np.zeros((B - 8, V), a.dtype)])
  direct, _, _ = run(pad(logits), params, pad(slot_prompt[rows]), pad(slot_counts[rows]),
                     list(range(8)), [0] * 8)
  np.testing.assert_array_equal(gathered.tokens, direct.tokens[:8])


def test_tiny_vocab():
  """V smaller than num_top and than a block: top logprobs pad with -inf."""
  rng = np.random.default_rng(14)
  b, v = 3, 7
  logits = make_logits(rng, b, v)
  prompt, counts = make_state(rng, b, v)
  params = [SamplingParams(top_k=3, logprobs=20), SamplingParams(top_p=0.5, min_p=0.2),
            SamplingParams(temperature=0.0, presence_penalty=1.0)]
  out = check_against_reference(logits, params, prompt, counts)
  assert out.top_ids.shape == (b, MAX_LOGPROBS)
  top = np.asarray(out.top_logprobs)
  assert np.all(np.isneginf(top[:, v:])) and np.all(np.isfinite(top[:, :v]))


def test_seed_layout_is_jax_key():
  t = SamplingTensors.build([SamplingParams()] * 2, [7, 2**40 + 5], [0, 0], 2)
  np.testing.assert_array_equal(t.seed[0], jax.random.key_data(jax.random.key(7)))
  np.testing.assert_array_equal(t.seed[1], [2**8, 5])


def test_seeds_take_the_whole_uint64_range():
  """Seeds up to 2^64 - 1 (gRPC's uint64) are keys of their own: 2^64 - 1 draws the same
  tokens twice, and other tokens than 2^63 - 1, the seed it would fold onto modulo 2^63."""
  top = 2**64 - 1
  t = SamplingTensors.build([SamplingParams()] * 3, [top, 2**63, 2**63 - 1], [0] * 3, 3)
  np.testing.assert_array_equal(t.seed, [[2**32 - 1] * 2, [2**31, 0], [2**31 - 1, 2**32 - 1]])
  rng = np.random.default_rng(11)
  logits = np.repeat(make_logits(rng, 1, V, scale=0.1), B, 0)  # near-uniform over V tokens
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  seeds = [top, top, top % 2**63] + list(range(B - 3))
  draws = [run(logits, [SamplingParams(temperature=1.0)] * B, *zero, seeds, [step] * B)[0]
           for step in range(6)]
  tokens = np.asarray([np.asarray(d.tokens) for d in draws])  # [step, row]
  assert (tokens[:, 0] == tokens[:, 1]).all()
  assert (tokens[:, 0] != tokens[:, 2]).any()


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.3, top_k=6, top_p=0.9)])
def test_sampling_frequencies_matchsoftmax(kw):
  """Chi-square of 4096 seeded draws against the reference distribution (16 live tokens)."""
  rng = np.random.default_rng(6)
  calls = 256
  row = np.full(V, -np.inf, np.float32)
  row[rng.choice(V, 16, replace=False)] = rng.standard_normal(16) * 1.5
  params = SamplingParams(**kw)
  probs = softmax(ref_filtered(row, params, np.zeros(V, bool), np.zeros(V, np.int32)))
  logits = np.repeat(row[None], B, 0)
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  tokens = []
  for c in range(calls):
    t = SamplingTensors.build([params] * B, list(range(B)), [c] * B, B)
    tokens.append(_sample(logits, t, *zero).tokens)
  chi_square(np.concatenate(jax.device_get(tokens)), probs, B * calls)


def test_logprobs_are_raw_log_softmax_sorted():
  rng = np.random.default_rng(7)
  logits = make_logits(rng)
  prompt, counts = make_state(rng)
  params = [SamplingParams(temperature=0.6, repetition_penalty=1.5, top_k=20, logprobs=5)] * B
  out = check_against_reference(logits, params, prompt, counts)
  lsm = np.stack([ref_log_softmax(r) for r in logits])
  np.testing.assert_allclose(out.logprob, lsm[np.arange(B), out.tokens], atol=1e-5)
  assert out.top_ids.shape == (B, MAX_LOGPROBS)
  want_ids = np.argsort(-lsm, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
  np.testing.assert_array_equal(out.top_ids, want_ids)
  np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lsm, want_ids, -1), atol=1e-5)
  assert np.all(np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0)


def test_no_logprobs_requested_gives_zeros():
  rng = np.random.default_rng(8)
  logits = make_logits(rng)
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  out, _, _ = run(logits, [SamplingParams(top_k=4)] * B, *zero)
  assert not np.any(out.logprob) and not np.any(out.top_ids) and not np.any(out.top_logprobs)
  only_sampled, _, _ = run(logits, [SamplingParams(logprobs=0)] * 2, *zero)
  assert np.all(np.asarray(only_sampled.logprob[:2]) < 0)


def test_padding_rows_are_harmless():
  rng = np.random.default_rng(9)
  logits = make_logits(rng)
  prompt, counts = make_state(rng)
  params = [SamplingParams(top_p=0.9, presence_penalty=1.0), SamplingParams(top_k=30)]
  clean = check_against_reference(logits, params, prompt, counts)
  noisy = logits.copy()
  noisy[2:] = np.nan
  out, _, _ = run(noisy, params, prompt, counts)
  np.testing.assert_array_equal(out.tokens[:2], clean.tokens[:2])
  t = SamplingTensors.build(params + [None], [1, 2, 3], [0, 0, 0], B)
  assert t.temperature[2:].max() == 0 and t.top_k[2:].max() == -1 and t.top_p[2:].min() == 1
  assert t.repetition_penalty[2:].min() == 1 and t.num_logprobs[2:].max() == -1


def test_one_compilation_serves_every_parameter_mix():
  rng = np.random.default_rng(10)
  logits = make_logits(rng)
  prompt, counts = make_state(rng)
  mixes = [[SamplingParams(temperature=0.0)] * B, [SamplingParams()] * B,
           [SamplingParams(top_k=3, logprobs=2)] * 3, [SamplingParams(top_p=0.5)] * B,
           [SamplingParams(top_k=900, min_p=0.1, repetition_penalty=1.1)] * 5, [None] * 2,
           [SamplingParams(top_p=0.99, temperature=3.0, frequency_penalty=1.0)] * B]
  sizes = []
  for i, mix in enumerate(mixes):
    t = SamplingTensors.build(mix, [i] * len(mix), [i] * len(mix), B)
    jax.block_until_ready(_sample(logits, t, prompt, counts))
    sizes.append(_sample._cache_size())
  assert sizes == sizes[:1] * len(mixes), sizes  # the first call may compile; no other does


def test_top_n_two_level_equals_lax_top_k():
  rng = np.random.default_rng(11)
  x = make_logits(rng, 3, 49152)
  x[0, :40000] = -np.inf
  x[1, 5:9] = x[1].max()  # ties at the top
  for n in (20, thresholds.TOP_K_CAP):
    vals, ids = jax.jit(reductions.top_n, static_argnums=1)(x, n)
    want, _ = jax.lax.top_k(x, n)
    np.testing.assert_array_equal(vals, want)
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1), want)


def test_build_validates():
  with pytest.raises(ValueError, match="do not fit"):
    SamplingTensors.build([None] * 3, [0] * 3, [0] * 3, 2)
  with pytest.raises(ValueError, match="one seed"):
    SamplingTensors.build([None] * 2, [0], [0, 0], 2)
