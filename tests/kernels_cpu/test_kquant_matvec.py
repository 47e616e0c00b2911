"""The native K-quant matvec (kernels_cpu/kquant_dot.h) against the XLA path it replaces.

GGUF Q4_K, Q5_K and Q6_K weights as the loader keeps them (random blocks
through `gguf_quantized_weight`) times 1 to 32 rows: with float activations the
kernel gives `QuantizedWeight.dequantize() @ x` up to float32 summation order;
with activations rounded per group of 32 to 8 or 16 bits (VNNI) it gives the
product with the rounded activations, its distance from the exact product the
rounding's. `matmul` routes these weights to the kernel and falls back to XLA
for what it cannot take.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kquant_testutil import Q, random_weight

import kernels_cpu
from kernels_cpu import matvec
from serving.models import quantized as quant

needs_native = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason="native kernels not built or CPU lacks AVX-512")
needs_vnni = pytest.mark.skipif(not kernels_cpu.library.vnni(),
                                reason="no native kernels or no VNNI")
K_TYPES = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}


def _weight(fmt, out_dim, in_dim, seed=0):
  qw = random_weight(np.random.default_rng(seed), K_TYPES[fmt], out_dim, in_dim)
  return jax.tree.map(jnp.asarray, qw)


def _reference(x, qw):
  return np.asarray(x, np.float64) @ np.asarray(qw.dequantize(), np.float64).T


def _uses(target, fn, *args) -> bool:
  return target in str(jax.make_jaxpr(fn)(*args))


def _x(rows, in_dim, seed):
  x = np.random.default_rng(seed).standard_normal((rows, in_dim)).astype(np.float32)
  x[0, :32] = 0.0  # an all-zero group (activation scale 0 in the integer tiles)
  return x


def test_kquant_format_names_the_loaders_layouts():
  for fmt in K_TYPES:
    qw = _weight(fmt, 4, 256)
    assert quant.kquant_format(qw) == fmt and quant.native_format(qw)
  legacy = random_weight(np.random.default_rng(0), Q.Q5_1, 4, 256)  # int5, no super-blocks
  assert quant.kquant_format(legacy) is None and not quant.native_format(legacy)


@needs_native
@pytest.mark.parametrize("fmt", list(K_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("out_dim,in_dim", [(40, 256), (67, 768)])
def test_float_activations_match_xla_path(fmt, rows, out_dim, in_dim):
  qw = _weight(fmt, out_dim, in_dim, seed=rows)
  x = jnp.asarray(_x(rows, in_dim, seed=out_dim))
  matmul = lambda w, x: w.matmul(x)  # noqa: E731
  assert _uses(f"xlaserve_{fmt}_matvec", matmul, qw, x)
  got = np.asarray(jax.jit(matmul)(qw, x))
  ref = _reference(x, qw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _rounded(x: np.ndarray, bits: int) -> np.ndarray:
  """x rounded per group of 32 as the integer tiles do (tests/kernels_cpu/test_matvec.py)."""
  g = x.reshape(x.shape[0], -1, 32).astype(np.float64)
  d = np.abs(g).max(-1, keepdims=True) / 127
  scaled = np.divide(g, d, out=np.zeros_like(g), where=d > 0)
  hi = np.clip(np.rint(scaled), -127, 127)
  lo = np.clip(np.rint((scaled - hi) * 256), -127, 127) if bits == 16 else 0
  return ((hi + lo / 256) * d).reshape(x.shape)


@needs_vnni
@pytest.mark.parametrize("fmt", list(K_TYPES))
@pytest.mark.parametrize("rows", [1, 8, 13, 14, 33, 64])
@pytest.mark.parametrize("bits", [8, 16])
def test_integer_activations_match_rounded_reference(fmt, rows, bits):
  """Exactly `rounded(x) @ W` up to float32 sums; from the exact product by the
  activations' rounding (under 2% of the output range with 8 bits, 256x less with 16).
  Rows past one tile of 8 and past the call's row blocks of 32 (prefill chunks) too."""
  in_dim = 768
  qw = _weight(fmt, 72, in_dim, seed=bits)
  x = _x(rows, in_dim, seed=rows)
  got = np.asarray(matvec.kquant_matvec(jnp.asarray(x), fmt, qw.q, qw.scale, qw.offset,
                                        qw.q_high, qw.super_scale, qw.super_offset,
                                        activation_bits=bits))
  exact = _reference(x, qw)
  span = np.abs(exact).max()
  np.testing.assert_allclose(got, _reference(_rounded(x, bits), qw), atol=2e-5 * span)
  assert np.abs(got - exact).max() < (0.02 if bits == 8 else 1e-4) * span
  # The engine marks K-quants for the integer tiles (`with_activation_bits`), and
  # `matmul` routes them there.
  marked = quant.with_activation_bits({"w": qw}, bits)["w"]
  assert marked.activation_bits == bits
  assert _uses(f"xlaserve_{fmt}_matvec_q{bits}", lambda w, x: w.matmul(x), marked,
               jnp.asarray(x))


@needs_native
def test_matmul_falls_back_where_the_kernel_cannot_take_it():
  qw = _weight("q4_k", 16, 256)
  matmul = lambda w, x: w.matmul(x)  # noqa: E731
  assert not _uses("_matvec", matmul, qw, jnp.ones((matvec.MAX_ROWS + 1, 256)))  # rows
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), qw)
  assert not matvec.supports_kquant(1, "q4_k", stacked.q, stacked.scale, stacked.offset,
                                    None, stacked.super_scale, stacked.super_offset)
  six = _weight("q6_k", 16, 256)
  assert not matvec.supports_kquant(1, "q6_k", six.q, six.scale.astype(jnp.uint8), None,
                                    six.q_high, six.super_scale, None)  # int8 scales only
  assert not matvec.supports_kquant(1, "q5_k", qw.q, qw.scale, qw.offset, None,
                                    qw.super_scale, qw.super_offset)  # Q5_K needs q_high
  x = jnp.ones((2, 256), jnp.float32)
  np.testing.assert_allclose(np.asarray(jax.jit(matmul)(qw, jnp.ones((33, 256))))[:2],
                             _reference(x, qw), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("fmt", list(K_TYPES))
def test_dense_copy_of_kquants(fmt):
  """`with_full_copies` dequantizes K-quants on the host exactly as `dequantize`."""
  qw = _weight(fmt, 24, 512)
  both = quant.with_full_copies({"w": qw}, jnp.float32)["w"]
  np.testing.assert_allclose(np.asarray(both.full), np.asarray(qw.dequantize()), rtol=1e-6,
                             atol=1e-8)
  assert dataclasses.replace(both, full=None).nbytes == qw.nbytes
