"""Token masks in the sampler (structured output) against a numpy reference.

The reference masks the logits with llguidance's own numpy implementation
(`apply_token_bitmask_inplace`), then samples with test_sampling's row-by-row
reference; tokens must agree exactly, and a masked-out token is never drawn.
"""

import dataclasses

import jax
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from test_sampling import B, V, ref_log_softmax, ref_token

from serving.runner.sampling import SamplingTensors, apply_token_mask, sample
from serving.types import SamplingParams

W = (V + 31) // 32
_sample = jax.jit(lambda *a, allowed: sample(*a, allowed=allowed))


def random_masks(rng, density):
  """[B, W] packed masks with about `density` of the V tokens allowed (at least one)."""
  bits = rng.random((B, W * 32)) < density
  bits[:, V:] = False
  bits[np.arange(B), rng.integers(0, V, B)] = True
  return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_apply_token_mask_matches_llguidance_numpy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((B, V)).astype(np.float32)
  masks = random_masks(rng, 0.3)
  want = logits.copy()
  llg_numpy.apply_token_bitmask_inplace(want, masks)
  np.testing.assert_array_equal(np.asarray(apply_token_mask(logits, masks)), want)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0),
                                dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
                                dict(temperature=1.0, repetition_penalty=1.3,
                                     presence_penalty=0.5)])
@pytest.mark.parametrize("density", [0.002, 0.5])
def test_masked_sampling_matches_reference(kw, density):
  rng = np.random.default_rng(int(density * 1000) + len(kw))
  logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
  masks = random_masks(rng, density)
  masks[-1] = -1  # an unconstrained row
  prompt = rng.random((B, V)) < 0.01
  counts = (rng.random((B, V)) < 0.01).astype(np.int32)
  params = SamplingParams(**kw)
  t = SamplingTensors.build([params] * B, list(range(B)), [3] * B, B)
  t = dataclasses.replace(t, num_logprobs=np.full(B, 2, np.int32))
  out = jax.device_get(_sample(logits, t, prompt, counts, allowed=masks))
  masked = logits.copy()
  llg_numpy.apply_token_bitmask_inplace(masked, masks)
  for i in range(B):
    assert out.tokens[i] == ref_token(masked[i], params, prompt[i], counts[i], i, 3), i
    bit = (masks[i, out.tokens[i] // 32] >> (out.tokens[i] % 32)) & 1
    assert bit == 1
    # Logprobs stay the model's: log_softmax of the unmasked logits.
    np.testing.assert_allclose(out.logprob[i], ref_log_softmax(logits[i])[out.tokens[i]],
                               rtol=1e-4, atol=1e-4)


def test_all_ones_mask_changes_nothing():
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((B, V)).astype(np.float32)
  zero = np.zeros((B, V), bool), np.zeros((B, V), np.int32)
  t = SamplingTensors.build([SamplingParams(temperature=1.0)] * B, list(range(B)), [0] * B, B)
  ones = np.full((B, W), -1, np.int32)
  a = jax.device_get(_sample(logits, t, *zero, allowed=ones).tokens)
  b = jax.device_get(jax.jit(sample)(logits, t, *zero).tokens)
  np.testing.assert_array_equal(a, b)
