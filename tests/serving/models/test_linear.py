"""`layers.dot_f32_accumulate` / `layers.linear`: every row count and dtype gives the reference.

A single row of bfloat16 operands is padded to two on CPU (XLA:CPU's one-row
bf16 dot is a slow naive loop); the padding must not change shapes or values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.models import layers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape", [(7,), (1, 7), (1, 1, 7), (3, 7), (2, 3, 7)])
def test_linear_matches_float64_reference(dtype, x_shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = jnp.asarray(rng.standard_normal((7, 5)), dtype)
  got = jax.jit(layers.linear)(jnp.asarray(x), w)
  assert got.shape == x_shape[:-1] + (5,) and got.dtype == jnp.float32
  # The reference sees exactly what the kernel sees: x rounded to w's dtype.
  xr = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  want = xr @ np.asarray(w.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_tied_head_spec(rows):
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32)
  emb = jnp.asarray(rng.standard_normal((11, 6)), jnp.bfloat16)
  got = layers.dot_f32_accumulate("bd,vd->bv", hidden, emb)
  want = hidden.astype(jnp.bfloat16).astype(jnp.float32) @ emb.astype(jnp.float32).T
  assert got.shape == (rows, 11)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_single_bf16_row_is_padded_on_cpu():
  """The one-row bf16 dot compiles to a two-row dot (the fast XLA:CPU path)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the padding is a CPU-only workaround")
  w = jnp.zeros((64, 32), jnp.bfloat16)
  hlo = jax.jit(layers.linear).lower(jnp.zeros((1, 64), jnp.float32), w).as_text()
  assert "tensor<2x64xbf16>" in hlo, hlo
  hlo32 = jax.jit(layers.linear).lower(jnp.zeros((1, 64), jnp.float32),
                                      w.astype(jnp.float32)).as_text()
  assert "tensor<2x64x" not in hlo32
