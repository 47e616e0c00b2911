"""The Gated DeltaNet math (serving/models/gated_delta.py) against transformers'
torch reference functions (Qwen3-Next): packed chunks from initial states, the
recurrent step, the causal conv."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as ref  # noqa: E402

from serving.models import gated_delta as gd  # noqa: E402

NV, NK, DK, DV = 4, 2, 8, 6


def _inputs(rng, t):
  q = rng.standard_normal((t, NK, DK)).astype(np.float32)
  k = rng.standard_normal((t, NK, DK)).astype(np.float32)
  v = rng.standard_normal((t, NV, DV)).astype(np.float32)
  g = -np.abs(rng.standard_normal((t, NV))).astype(np.float32) * 0.5
  beta = rng.uniform(0, 1, (t, NV)).astype(np.float32)
  return q, k, v, g, beta


def _torch_rule(q, k, v, g, beta, init, chunk=None):
  args = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
  s0 = torch.from_numpy(init)[None]
  if chunk is None:
    out, s = ref.torch_recurrent_gated_delta_rule(*args, initial_state=s0,
                                                  output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
  else:
    out, s = ref.torch_chunk_gated_delta_rule(*args, chunk_size=chunk, initial_state=s0,
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
  return out[0].numpy(), s[0].numpy()


def _prep(q, k):
  qn = gd.expand_heads(gd.l2norm(jnp.asarray(q)), NV) * DK ** -0.5
  kn = gd.expand_heads(gd.l2norm(jnp.asarray(k)), NV)
  return qn, kn


@pytest.mark.parametrize("lens", [(5,), (3, 17, 0, 8), (16, 1)])
def test_chunked_packed_matches_transformers(lens):
  rng = np.random.default_rng(len(lens))
  chunk, c = 4, len(lens) + 1  # one padding chunk row
  t = sum(lens) + 5  # padding rows after the chunks
  q, k, v, g, beta = _inputs(rng, t)
  init = rng.standard_normal((c, NV, DK, DV)).astype(np.float32)
  cu = np.zeros(c + 1, np.int32)
  cu[1:len(lens) + 1] = np.cumsum(lens)
  cu[len(lens) + 1:] = cu[len(lens)]
  qn, kn = _prep(q, k)
  out, final = gd.chunked_rule_packed(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
                                      jnp.asarray(init), jnp.asarray(cu), chunk)
  for i, n in enumerate(lens):
    s = slice(cu[i], cu[i + 1])
    if n == 0:
      np.testing.assert_allclose(final[i], init[i])
      continue
    want, want_s = _torch_rule(q[s], k[s], v[s], g[s], beta[s], init[i], chunk=chunk)
    np.testing.assert_allclose(out[s], want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(final[i], want_s, atol=2e-5, rtol=2e-5)
    want_r, want_rs = _torch_rule(q[s], k[s], v[s], g[s], beta[s], init[i])
    np.testing.assert_allclose(out[s], want_r, atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(out[cu[-1]:]))


def test_recurrent_step_matches_transformers():
  rng = np.random.default_rng(7)
  q, k, v, g, beta = _inputs(rng, 3)
  init = rng.standard_normal((3, NV, DK, DV)).astype(np.float32)
  qn, kn = _prep(q, k)
  out, s = gd.recurrent_step(qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
                             jnp.asarray(init))
  for b in range(3):
    want, want_s = _torch_rule(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1],
                               beta[b:b + 1], init[b])
    np.testing.assert_allclose(out[b], want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s[b], want_s, atol=1e-5, rtol=1e-5)


def test_conv_packed_and_step_match_torch_conv():
  rng = np.random.default_rng(3)
  kc, f, lens = 4, 5, (2, 7)
  t = sum(lens) + 3
  x = rng.standard_normal((t, f)).astype(np.float32)
  w = rng.standard_normal((kc, f)).astype(np.float32)
  init = rng.standard_normal((2, kc - 1, f)).astype(np.float32)
  cu = np.array([0, 2, 9], np.int32)
  out, state = gd.causal_conv_packed(jnp.asarray(x), jnp.asarray(w), jnp.asarray(init),
                                     jnp.asarray(cu))
  for i in range(2):
    xs = np.concatenate([init[i], x[cu[i]:cu[i + 1]]])  # state then the chunk
    conv = torch.nn.functional.conv1d(torch.from_numpy(xs.T)[None],
                                      torch.from_numpy(w.T)[:, None], groups=f)
    want = torch.nn.functional.silu(conv)[0].numpy().T
    np.testing.assert_allclose(out[cu[i]:cu[i + 1]], want, atol=1e-5)
    np.testing.assert_allclose(state[i], xs[-(kc - 1):])
  o1, s1 = gd.conv_step(jnp.asarray(x[:2]), jnp.asarray(w), jnp.asarray(init))
  for i in range(2):
    xs = np.concatenate([init[i], x[i:i + 1]])
    np.testing.assert_allclose(o1[i], np.asarray(jax_silu((xs * w).sum(0))), atol=1e-5)
    np.testing.assert_allclose(s1[i], xs[1:])


def jax_silu(x):
  return x / (1 + np.exp(-x))
