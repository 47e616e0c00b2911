"""The native quantized matvec (kernels_cpu) against the XLA path it replaces.

The XLA path (`QuantizedWeight.dequantize` + an f32 einsum) is the reference:
the kernel must give the same values up to float32 summation order for every
row count it takes, every code format (uint8 with a min, symmetric int8 /
Q8_0, nibbles with a min / Q4_1 and without / Q4_0) and group counts that are
not multiples of its 16-group scale loads.
`QuantizedWeight.matmul` must route exactly the supported cases to it and
fall back to the XLA path otherwise, including when the library is off.
"""

import dataclasses
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from checkpoints import quantizers
from kernels_cpu import matvec

needs_native = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason="native kernels not built or CPU lacks AVX-512")


def test_built_on_x86():
  """pip install builds the library on x86-64 (the kernels are optional elsewhere; a
  Bazel build compiles none)."""
  if os.environ.get("TEST_SRCDIR"):
    pytest.skip("Bazel does not build the native library (setup.py does)")
  if platform.machine().lower() in ("x86_64", "amd64"):
    assert matvec.library_path() is not None


def _weight(out_dim, in_dim, asymmetric, seed=0):
  w = (np.random.default_rng(seed).standard_normal((in_dim, out_dim)) * 0.05).astype(np.float32)
  return jax.tree.map(jnp.asarray, quantizers.quantize_int8(w, 32, asymmetric=asymmetric))


def _reference(x, qw):
  return np.asarray(x, np.float32) @ np.asarray(qw.dequantize()).T


@needs_native
@pytest.mark.parametrize("asymmetric", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32])  # tiles of 8 rows, a partial one
@pytest.mark.parametrize("out_dim,in_dim", [(96, 576), (37, 96), (130, 1536)])
def test_matches_xla_path(asymmetric, rows, out_dim, in_dim):
  qw = _weight(out_dim, in_dim, asymmetric)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, in_dim)).astype(np.float32))
  got = jax.jit(matvec.int8_matvec)(x, qw.q, qw.scale, qw.offset)
  np.testing.assert_allclose(np.asarray(got), _reference(x, qw), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("asymmetric", [True, False])  # Q4_1, Q4_0
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
@pytest.mark.parametrize("out_dim,in_dim", [(96, 576), (37, 96), (130, 1536)])
def test_nibbles_match_xla_path(asymmetric, rows, out_dim, in_dim):
  w = (np.random.default_rng(out_dim).standard_normal((in_dim, out_dim)) * 0.05).astype(np.float32)
  qw = jax.tree.map(jnp.asarray, quantizers.quantize_int4(w, 32, asymmetric=asymmetric))
  assert (qw.offset is not None) == asymmetric
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, in_dim)).astype(np.float32))
  assert _uses_native(lambda w, x: w.matmul(x), qw, x)
  got = jax.jit(lambda w, x: w.matmul(x))(qw, x)
  np.testing.assert_allclose(np.asarray(got), _reference(x, qw), rtol=1e-5, atol=1e-5)


def _uses_native(fn, *args) -> bool:
  return "_matvec" in str(jax.make_jaxpr(fn)(*args))


@needs_native
def test_matmul_routes_up_to_max_rows_to_the_kernel():
  qw = _weight(64, 96, True)
  few = jnp.ones((4, 8, 96), jnp.float32)  # 32 rows: the kernel, leading axes kept
  assert _uses_native(lambda w, x: w.matmul(x), qw, jnp.ones((matvec.MAX_ROWS, 96)))
  many = jnp.ones((matvec.MAX_ROWS + 1, 96), jnp.float32)  # the XLA path
  assert _uses_native(lambda w, x: w.matmul(x), qw, few)
  assert not _uses_native(lambda w, x: w.matmul(x), qw, many)
  out = jax.jit(lambda w, x: w.matmul(x))(qw, few)
  assert out.shape == (4, 8, 64)
  np.testing.assert_allclose(np.asarray(out).reshape(32, 64), _reference(few.reshape(32, 96), qw),
                             rtol=1e-5, atol=1e-5)
  # Not groups of 32 of int8 codes or nibbles (per channel, group 64, fp8): the XLA path.
  w = np.random.default_rng(1).standard_normal((128, 64)).astype(np.float32)
  for other in (quantizers.quantize_int8(w, 0), quantizers.quantize_int8(w, 64),
                quantizers.quantize_int4(w, 64), quantizers.quantize_fp8(w)):
    assert not _uses_native(lambda w, x: w.matmul(x), jax.tree.map(jnp.asarray, other),
                            jnp.ones((1, 128), jnp.float32))


def test_fallback_when_off(monkeypatch):
  """XLASERVE_NATIVE=0 (or no library): the XLA path, same values."""
  qw = _weight(48, 96, True)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 96)).astype(np.float32))
  matvec.available.cache_clear()
  monkeypatch.setenv("XLASERVE_NATIVE", "0")
  try:
    assert not kernels_cpu.available()
    assert not _uses_native(lambda w, x: w.matmul(x), qw, x)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w, x: w.matmul(x))(qw, x)),
                               _reference(x, qw), rtol=1e-5, atol=1e-5)
  finally:
    monkeypatch.delenv("XLASERVE_NATIVE")
    matvec.available.cache_clear()


def test_supports_rejects_what_the_kernel_cannot_take():
  q = jnp.zeros((16, 64), jnp.uint8)
  s = jnp.zeros((16, 2), jnp.float16)
  assert matvec.supports(1, q, s, s)
  assert matvec.supports(matvec.MAX_ROWS, q, s, s)
  assert not matvec.supports(matvec.MAX_ROWS + 1, q, s, s)  # too many rows
  assert not matvec.supports(1, q, s, None)  # uint8 codes need their mins
  assert not matvec.supports(1, q.astype(jnp.int8), s, s)  # int8 codes have none
  assert not matvec.supports(1, jnp.zeros((16, 48), jnp.uint8), s, s)  # 48 % 32
  assert not matvec.supports(1, q, s.astype(jnp.float32), s)  # float16 scales only
  assert not matvec.supports(1, jnp.zeros((2, 16, 64), jnp.uint8), s, s)  # stacked
  assert matvec.supports(1, jnp.zeros((16, 32), jnp.uint8), s, s, bits=4)  # Q4_1
  assert matvec.supports(1, jnp.zeros((16, 32), jnp.uint8), s, None, bits=4)  # Q4_0
  assert not matvec.supports(1, q, s, s, bits=4)  # 64 bytes of nibbles are 128 inputs
  assert not matvec.supports(1, q, s, s, bits=5)


@needs_native
def test_dense_copy_takes_prefill_and_large_batches():
  """`quantized_dense_copy`: small batches read the codes (the kernel), larger ones
  multiply the dequantized copy; a format the kernel does not read gets no copy."""
  from serving.models import quantized as quant

  w = (np.random.default_rng(4).standard_normal((96, 64)) * 0.05).astype(np.float32)
  qw = jax.tree.map(jnp.asarray, quantizers.quantize_int4(w, 32))
  both = jax.tree.map(jnp.asarray, quant.with_full_copies({"w": qw}, jnp.float32)["w"])
  np.testing.assert_allclose(np.asarray(both.full), np.asarray(qw.dequantize()), rtol=1e-6,
                             atol=1e-7)
  for fmt in (quantizers.quantize_int4(w, 32, asymmetric=False),  # Q4_0, Q8_0, int8 + min
              quantizers.quantize_int8(w, 32, asymmetric=False), quantizers.quantize_int8(w, 32)):
    copy = quant.with_full_copies({"w": fmt}, jnp.float32)["w"].full
    np.testing.assert_allclose(copy, np.asarray(jax.tree.map(jnp.asarray, fmt).dequantize()),
                               rtol=1e-6, atol=1e-7)
  matmul = lambda w, x: w.matmul(x)  # noqa: E731
  few = jnp.asarray(np.random.default_rng(5).standard_normal(
      (quant.NATIVE_ROWS_BESIDE_FULL, 96)).astype(np.float32))
  many = jnp.concatenate([few, few[:1]])
  assert _uses_native(matmul, both, few) and not _uses_native(matmul, both, many)
  for x in (few, many):
    np.testing.assert_allclose(np.asarray(jax.jit(matmul)(both, x)), _reference(x, qw),
                               rtol=1e-5, atol=1e-5)
  per_channel = quantizers.quantize_int8(w, 0)
  assert quant.with_full_copies({"w": per_channel}, jnp.float32)["w"].full is None


def _rounded(x: np.ndarray, bits: int) -> np.ndarray:
  """x [B, I] rounded per group of 32 as the integer tiles do: hi = rint(x / d) with
  d = max|x| / 127 (llama.cpp's Q8), and for 16 bits the remainder too, lo = rint((x / d
  - hi) * 256) in [-127, 127]; -> d * (hi + lo / 256)."""
  g = x.reshape(x.shape[0], -1, 32).astype(np.float64)
  d = np.abs(g).max(-1, keepdims=True) / 127
  scaled = np.divide(g, d, out=np.zeros_like(g), where=d > 0)
  hi = np.clip(np.rint(scaled), -127, 127)
  lo = np.clip(np.rint((scaled - hi) * 256), -127, 127) if bits == 16 else 0
  return ((hi + lo / 256) * d).reshape(x.shape)


@pytest.mark.skipif(not kernels_cpu.library.vnni(), reason="no native kernels or no VNNI")
@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
@pytest.mark.parametrize("rows", [1, 8, 13])
@pytest.mark.parametrize("bits", [8, 16])
def test_integer_activations_match_rounded_reference(fmt, rows, bits):
  """The VNNI kernel is exactly `rounded(x) @ W` (up to float32 sums); its distance from
  the exact product is the activations' rounding: under 2% of the output range with 8
  bits, 256x less with 16."""
  w = (np.random.default_rng(6).standard_normal((576, 96)) * 0.05).astype(np.float32)
  if fmt == "q8_0":
    qw = jax.tree.map(jnp.asarray, quantizers.quantize_int8(w, 32, asymmetric=False))
    qw = dataclasses.replace(qw, q=qw.q.at[0, :4].set(jnp.int8(-128)))  # the one unpaired code
  else:
    qw = jax.tree.map(jnp.asarray, quantizers.quantize_int4(w, 32, asymmetric=fmt == "q4_1"))
  x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
  x[0, :32] = 0.0  # an all-zero group (scale 0)
  got = np.asarray(matvec.quantized_matvec(jnp.asarray(x), qw.q, qw.scale, qw.offset,
                                           qw.bits, activation_bits=bits))
  exact = _reference(x, qw)
  span = np.abs(exact).max()
  np.testing.assert_allclose(got, _reference(_rounded(x, bits), qw), atol=2e-5 * span)
  assert np.abs(got - exact).max() < (0.02 if bits == 8 else 1e-4) * span
  marked = dataclasses.replace(qw, activation_bits=bits)
  integer_targets = ("matvec_q8", "matvec_s8_q8") if bits == 8 else ("matvec_q16", "matvec_s8_q16")
  traced = str(jax.make_jaxpr(lambda w, x: w.matmul(x))(marked, jnp.asarray(x)))
  assert any(t in traced for t in integer_targets)
  float_traced = str(jax.make_jaxpr(lambda w, x: w.matmul(x))(qw, jnp.asarray(x)))
  assert "_q8" not in float_traced and "_q16" not in float_traced


def _format_weight(fmt: str, out_dim: int, in_dim: int):
  """A quantized `[In, Out]` weight in one of the kernel's code formats."""
  w = (np.random.default_rng(7).standard_normal((in_dim, out_dim)) * 0.05).astype(np.float32)
  if fmt in ("u8", "q8_0"):
    return jax.tree.map(jnp.asarray, quantizers.quantize_int8(w, 32, asymmetric=fmt == "u8"))
  return jax.tree.map(jnp.asarray, quantizers.quantize_int4(w, 32, asymmetric=fmt == "q4_1"))


_INVARIANCE_CASES = [(fmt, bits) for fmt in ("u8", "q8_0", "q4_1", "q4_0") for bits in (32, 16, 8)
                     if bits == 32 or fmt != "u8"]


@needs_native
@pytest.mark.parametrize("fmt,bits", _INVARIANCE_CASES)
def test_a_row_gives_the_same_bits_in_any_batch(fmt, bits):
  """Batch invariance: a row's outputs are bitwise the same multiplied alone or at any
  position of a 1-, 7-, 33- or 300-row call (full and partial row tiles, several row
  blocks), over more columns than one column sub-block holds (and not a multiple of
  the wide tiles' four)."""
  if bits != 32 and not kernels_cpu.library.vnni():
    pytest.skip("integer activations need VNNI")
  out_dim, in_dim = 1030, 576  # 18 groups: a partial 16-group scale load
  qw = _format_weight(fmt, out_dim, in_dim)
  rng = np.random.default_rng(8)
  row = rng.standard_normal((1, in_dim)).astype(np.float32)

  def product(x):
    return np.asarray(matvec.quantized_matvec(jnp.asarray(x), qw.q, qw.scale, qw.offset,
                                              qw.bits, activation_bits=bits))

  alone = product(row)
  np.testing.assert_allclose(alone, _reference(_rounded(row, bits) if bits != 32 else row, qw),
                             rtol=1e-4, atol=1e-4)
  for rows, at in ((1, 0), (7, 0), (7, 5), (33, 32), (33, 12), (300, 0), (300, 150),
                   (300, 299)):
    x = rng.standard_normal((rows, in_dim)).astype(np.float32) * rng.uniform(0.1, 10.0)
    x[at] = row[0]
    got = product(x)
    assert np.array_equal(got[at], alone[0]), (rows, at)
