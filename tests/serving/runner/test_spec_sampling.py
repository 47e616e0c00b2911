"""Tests of the speculative verifier (serving/runner/sampling/speculative.py).

Greedy rows are compared token for token with sequential decoding by the numpy
reference (tests/sampling_ref.py); random rows by chi-square against the
distributions sequential sampling draws from, penalties and filters included;
a row without drafts draws exactly what `sample` draws.
"""

import jax
import jax.numpy as jnp
import numpy as np
from sampling_ref import chi_square, ref_filtered, ref_log_softmax, ref_penalise, softmax

from serving.runner.sampling import SamplingTensors, sample, verify
from serving.runner.steps import DeviceState, verify_sample_step
from serving.types import SamplingParams

_verify = jax.jit(lambda logits, drafts, n, t, pm, oc, rows, allowed: verify(
    logits, drafts, n, t, pm, oc, rows=rows, allowed=allowed))


def _run(logits, drafts, num_drafts, params, prompt, counts, seeds=None, step=0, allowed=None):
  b, s, v = logits.shape
  seeds = list(range(10, 10 + b)) if seeds is None else seeds
  t = SamplingTensors.build(params, seeds, [step] * b, b)
  if allowed is None:
    allowed = np.full((b, s, (v + 31) // 32), -1, np.int32)
  out = _verify(logits, np.asarray(drafts, np.int32), np.asarray(num_drafts, np.int32), t,
                prompt, counts, np.arange(b, dtype=np.int32), allowed)
  return jax.device_get(out)


def pack(keep: np.ndarray) -> np.ndarray:
  """[..., V] bool -> [..., ceil(V / 32)] int32 packed masks (bit v % 32 of word v // 32)."""
  v = keep.shape[-1]
  padded = np.zeros((*keep.shape[:-1], -(-v // 32) * 32), bool)
  padded[..., :v] = keep
  return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def _sequential_greedy(logits_row, p, prompt, counts, steps):
  """Tokens sequential greedy decoding emits at positions 0..steps-1 of one row."""
  counts = counts.copy()
  out = []
  for j in range(steps):
    tok = int(np.argmax(ref_penalise(logits_row[j], p, prompt, counts)))
    out.append(tok)
    counts[tok] += 1
  return out


def test_greedy_rows_equal_sequential_decoding():
  """Drafts equal to what greedy decoding emits are all kept; the first wrong one is
  replaced by the greedy token, with penalties counting the kept drafts."""
  rng = np.random.default_rng(0)
  b, s, v = 8, 5, 40
  logits = (rng.standard_normal((b, s, v)) * 2).astype(np.float32)
  prompt = rng.random((b, v)) < 0.2
  counts = rng.poisson(0.3, (b, v)).astype(np.int32)
  params = [SamplingParams(temperature=0.0, frequency_penalty=0.8 * (i % 2),
                           repetition_penalty=1.0 + 0.5 * (i % 3 == 0)) for i in range(b)]
  num_drafts = [4, 4, 3, 2, 1, 0, 4, 4]
  wrong_at = [None, 0, 1, None, 0, None, 3, 2]  # draft index made wrong (None: all right)
  drafts = np.zeros((b, s - 1), np.int32)
  want = []
  for i in range(b):
    seq = _sequential_greedy(logits[i], params[i], prompt[i], counts[i], s)
    d = list(seq[:num_drafts[i]])
    if wrong_at[i] is not None and wrong_at[i] < num_drafts[i]:
      d[wrong_at[i]] = (seq[wrong_at[i]] + 1) % v
      kept = wrong_at[i]
    else:
      kept = num_drafts[i]
    drafts[i, :len(d)] = d
    want.append((kept, seq[:kept + 1]))
  out = _run(logits, drafts, num_drafts, params, prompt, counts)
  for i, (kept, tokens) in enumerate(want):
    assert int(out.num_accepted[i]) == kept, i
    assert list(out.tokens[i, :kept + 1]) == tokens, i
    assert not out.tokens[i, kept + 1:].any()


def test_token_masks_apply_per_position():
  """Structured output: position j's mask constrains the token there (the greedy choice
  is the best allowed one); a row without drafts draws what `sample` draws with the
  same mask; logprobs stay raw."""
  rng = np.random.default_rng(4)
  b, s, v = 4, 3, 40
  logits = (rng.standard_normal((b, s, v)) * 2).astype(np.float32)
  keep = rng.random((b, s, v)) < 0.3
  keep[..., 0] = True
  allowed = pack(keep)
  masked = np.where(keep, logits, -np.inf)
  best = masked.argmax(-1)  # [B, S]
  drafts = best[:, :2].astype(np.int32)
  zero = np.zeros((b, v), bool), np.zeros((b, v), np.int32)
  greedy = [SamplingParams(temperature=0.0, logprobs=1)] * b
  out = _run(logits, drafts, [2, 2, 1, 0], greedy, *zero, allowed=allowed)
  np.testing.assert_array_equal(out.num_accepted, [2, 2, 1, 0])
  for i, n in enumerate([2, 2, 1, 0]):
    assert list(out.tokens[i, :n + 1]) == list(best[i, :n + 1])
    lsm = ref_log_softmax(logits[i, n])
    np.testing.assert_allclose(out.logprob[i, n], lsm[best[i, n]], atol=1e-5)
  params = [SamplingParams(temperature=0.9, top_p=0.9)] * b
  out = _run(logits, np.zeros((b, s - 1), np.int32), [0] * b, params, *zero, seeds=[1, 2, 3, 4],
             step=3, allowed=allowed)
  t = SamplingTensors.build(params, [1, 2, 3, 4], [3] * b, b)
  ref = jax.jit(sample)(logits[:, 0], t, *zero, allowed=allowed[:, 0])
  np.testing.assert_array_equal(out.tokens[:, 0], np.asarray(ref.tokens))
  assert keep[np.arange(b), 0, out.tokens[:, 0]].all()


def test_logprobs_are_raw_at_each_position():
  rng = np.random.default_rng(1)
  b, s, v = 4, 3, 30
  logits = (rng.standard_normal((b, s, v)) * 2).astype(np.float32)
  zero = np.zeros((b, v), bool), np.zeros((b, v), np.int32)
  greedy = logits.argmax(-1)
  drafts = greedy[:, :2].astype(np.int32)
  out = _run(logits, drafts, [2] * b, [SamplingParams(temperature=0.0, logprobs=3)] * b, *zero)
  assert (out.num_accepted == 2).all()
  for i in range(b):
    for j in range(s):
      lsm = ref_log_softmax(logits[i, j])
      np.testing.assert_allclose(out.logprob[i, j], lsm[out.tokens[i, j]], atol=1e-5)
      np.testing.assert_array_equal(out.top_ids[i, j, :3], np.argsort(-lsm)[:3])


def test_no_drafts_draws_exactly_what_sample_draws():
  rng = np.random.default_rng(2)
  b, s, v = 16, 3, 200
  logits = (rng.standard_normal((b, s, v)) * 2).astype(np.float32)
  prompt, counts = rng.random((b, v)) < 0.1, rng.poisson(0.1, (b, v)).astype(np.int32)
  params = [SamplingParams(temperature=0.7 + 0.1 * (i % 4), top_k=[-1, 5, 50][i % 3],
                           top_p=[1.0, 0.9][i % 2], min_p=[0.0, 0.05][i % 4 == 2],
                           presence_penalty=0.3 * (i % 5 == 0)) for i in range(b)]
  seeds = list(range(b))
  out = _run(logits, np.zeros((b, s - 1), np.int32), [0] * b, params, prompt, counts, seeds,
             step=7)
  t = SamplingTensors.build(params, seeds, [7] * b, b)
  ref = jax.jit(sample)(logits[:, 0], t, prompt, counts)
  np.testing.assert_array_equal(out.tokens[:, 0], np.asarray(ref.tokens))
  assert not out.num_accepted.any()


def test_rejection_sampling_preserves_the_distribution():
  """Chi-square over 8192 seeded rows on an 8-token vocabulary: the first emitted token
  follows p_0, the second (given the first draft kept) p_1 with d_1 counted by the
  frequency penalty, the third (given both kept) p_2."""
  v, s, b, calls = 8, 3, 1024, 8
  rng = np.random.default_rng(3)
  rows = (rng.standard_normal((s, v)) * 0.6).astype(np.float32)
  p = SamplingParams(temperature=0.9, top_k=7, top_p=0.97, min_p=0.02, frequency_penalty=0.7)
  prompt, counts = np.zeros(v, bool), np.zeros(v, np.int32)

  def dist(j, counted):
    c = counts.copy()
    for tok in counted:
      c[tok] += 1
    return softmax(ref_filtered(rows[j], p, prompt, c))

  p0 = dist(0, [])
  d1 = int(np.argsort(-p0)[1])  # a likely but not the likeliest token
  p1 = dist(1, [d1])
  d2 = int(np.argsort(-p1)[0])
  p2 = dist(2, [d1, d2])
  assert min((p0 > 0).sum(), (p1 > 0).sum(), (p2 > 0).sum()) >= 4  # not degenerate
  logits = np.broadcast_to(rows, (b, s, v)).copy()
  drafts = np.tile(np.array([[d1, d2]], np.int32), (b, 1))
  firsts, seconds, thirds = [], [], []
  for c in range(calls):
    out = _run(logits, drafts, [2] * b, [p] * b, np.zeros((b, v), bool),
               np.zeros((b, v), np.int32), seeds=list(range(c * b, (c + 1) * b)), step=c)
    firsts.append(out.tokens[:, 0])
    kept1 = out.num_accepted >= 1
    seconds.append(out.tokens[kept1, 1])
    thirds.append(out.tokens[out.num_accepted == 2, 2])
  firsts, seconds, thirds = map(np.concatenate, (firsts, seconds, thirds))
  n = b * calls
  chi_square(firsts, p0, n)
  assert abs(len(seconds) / n - p0[d1]) < 6 * np.sqrt(p0[d1] * (1 - p0[d1]) / n)
  chi_square(seconds, p1, len(seconds))
  chi_square(thirds, p2, len(thirds))


def test_verify_sample_step_records_the_emitted_tokens():
  v, b, s = 16, 2, 3
  state = DeviceState(kv=None, last_tokens=jnp.zeros((4,), jnp.int32),
                      prompt_mask=jnp.zeros((4, v), bool),
                      output_counts=jnp.zeros((4, v), jnp.int32))
  logits = np.full((b, s, v), -5.0, np.float32)
  logits[0, 0, 3] = logits[0, 1, 4] = logits[0, 2, 5] = 5.0  # row 0 greedy: 3, 4, 5
  logits[1, 0, 7] = logits[1, 1, 8] = 5.0  # row 1 greedy: 7, 8
  drafts = np.array([[3, 4], [9, 9]], np.int32)
  t = SamplingTensors.build([SamplingParams(temperature=0.0)] * b, [0, 1], [0, 0], b)
  allowed = np.full((b, s, 1), -1, np.int32)
  state, out = jax.jit(verify_sample_step)(state, logits, drafts, np.array([2, 2], np.int32),
                                           np.array([1, 2], np.int32), t, allowed)
  np.testing.assert_array_equal(out.num_accepted, [2, 0])
  np.testing.assert_array_equal(out.tokens, [[3, 4, 5], [7, 0, 0]])
  np.testing.assert_array_equal(state.last_tokens, [0, 5, 7, 0])
  counts = np.asarray(state.output_counts)
  assert counts[1, [3, 4, 5]].tolist() == [1, 1, 1] and counts[1].sum() == 3
  assert counts[2, 7] == 1 and counts[2].sum() == 1
