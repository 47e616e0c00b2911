"""A row-by-row numpy reference of the sampler with vLLM semantics, shared by the
sampling tests (tests/serving/runner/test_sampling.py, test_spec_sampling.py).

The reference draws by inverse CDF in vocabulary order with the uniform
`jax.random.uniform(fold_in(key(seed), step))` the sampler's contract prescribes.
"""

import jax
import numpy as np

from serving.types import SamplingParams


def ref_penalise(x, p, prompt, counts):
  """vLLM penalties on one f32 row: repetition (prompt + output), frequency, presence."""
  x = x.astype(np.float32).copy()
  rep = np.float32(p.repetition_penalty)
  seen = prompt | (counts > 0)
  x = np.where(seen, np.where(x > 0, x / rep, x * rep), x).astype(np.float32)
  x = x - np.float32(p.frequency_penalty) * counts.astype(np.float32)
  return x - np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)


def softmax(z):
  e = np.exp(z - np.max(z))
  return e / e.sum()


def ref_filtered(x, p, prompt, counts):
  """Penalised, temperature-scaled logits of a random row, -inf where filtered out."""
  z = (ref_penalise(x, p, prompt, counts) / np.float32(p.temperature)).astype(np.float64)
  if 0 < p.top_k < z.size:
    kth = np.sort(z)[-p.top_k]
    z = np.where(z < kth, -np.inf, z)
  if p.top_p < 1:  # vLLM: ascending sort, drop while cumulative mass <= 1 - p, keep the top
    order = np.argsort(z, kind="stable")
    cum = np.cumsum(softmax(z)[order])
    drop = cum <= 1 - p.top_p
    drop[-1] = False
    z = z.copy()
    z[order[drop]] = -np.inf
  if p.min_p > 0:
    probs = softmax(z)
    z = np.where(probs < p.min_p * probs.max(), -np.inf, z)
  return z


def uniform(seed, step):
  return float(jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step)))


def ref_token(x, p, prompt, counts, seed, step):
  if p is None or p.temperature < 1e-5:  # vLLM's _SAMPLING_EPS
    base = p or SamplingParams(temperature=0.0)
    return int(np.argmax(ref_penalise(x, base, prompt, counts)))
  cdf = np.cumsum(softmax(ref_filtered(x, p, prompt, counts)))
  return int(np.searchsorted(cdf, uniform(seed, step) * cdf[-1], side="right"))


def ref_log_softmax(x):
  x = x.astype(np.float64)
  return x - np.max(x) - np.log(np.sum(np.exp(x - np.max(x))))


def chi_square(tokens, probs, n):
  """Asserts that `tokens` (n draws) follow `probs`: a chi-square statistic within 6 sigma."""
  observed = np.bincount(tokens, minlength=probs.size)
  expected = probs * n
  assert observed[expected == 0].sum() == 0
  keep = expected > 0
  stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
  dof = keep.sum() - 1
  assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)
