"""Unit tests of serving/quant.py and the quantized KV cache rows (small, random)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving import kv_cache, quant

RNG = np.random.default_rng(0)


def _w(shape=(128, 96)):
  return RNG.standard_normal(shape).astype(np.float32) * 0.05


def _rel_err(w, qw):
  d = np.swapaxes(np.asarray(qw.dequantize()), -1, -2)
  return float(np.sqrt(np.mean((d - w) ** 2) / np.mean(w ** 2)))


@pytest.mark.parametrize("method,kw,bound", [
    ("int8", {}, 0.01), ("int8", dict(group_size=32), 0.01),
    ("int4", dict(group_size=32), 0.1), ("int4", dict(group_size=64), 0.12),
    ("fp8", {}, 0.05)])
def test_round_trip_error(method, kw, bound):
  w = _w()
  qw = quant.quantize_weight(w, method, **kw)
  assert qw.shape == w.shape
  assert _rel_err(w, qw) < bound


def test_symmetric_int4_and_group_fallback():
  w = _w((96, 32))
  assert _rel_err(w, quant.quantize_int4(w, 32, asymmetric=False)) < 0.15
  assert quant.quantize_weight(w, "int4", group_size=128).group_size == 32  # 96 % 64 != 0


def test_int4_nibble_order_is_gguf():
  """Byte j of a group holds input j (low nibble) and input j + g/2 (high nibble)."""
  codes = np.arange(16, dtype=np.uint8)[None, :]  # one output row, inputs 0..15 (g = 16)
  packed = (codes[:, :8] | (codes[:, 8:] << 4)).astype(np.uint8)
  qw = quant.QuantizedWeight(q=packed, scale=np.ones((1, 1), np.float16),
                             offset=np.zeros((1, 1), np.float16), kind="int4", group_size=16)
  np.testing.assert_array_equal(np.asarray(qw.dequantize())[0], np.arange(16))
  sym = quant.QuantizedWeight(q=packed, scale=np.full((1, 1), 0.5, np.float16), kind="int4",
                              group_size=16)
  np.testing.assert_array_equal(np.asarray(sym.dequantize())[0], (np.arange(16) - 8) * 0.5)


@pytest.mark.parametrize("method,kw", [("int8", {}), ("int8", dict(group_size=32)),
                                       ("int4", dict(group_size=32)), ("fp8", {})])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_and_lookup_match_dequantized(method, kw, rows):
  w = _w()
  qw = jax.tree.map(jnp.asarray, quant.quantize_weight(w, method, **kw))
  dense = np.swapaxes(np.asarray(qw.dequantize()), -1, -2)  # [In, Out]
  x = RNG.standard_normal((rows, w.shape[0])).astype(np.float32)
  out = jax.jit(lambda q, x: q.matmul(x))(qw, x)
  np.testing.assert_allclose(out, x @ dense, rtol=1e-4, atol=1e-4)
  ids = jnp.array([3, 0, 95])
  np.testing.assert_allclose(qw.lookup(ids), dense.T[ids], rtol=1e-6, atol=1e-6)


def test_stacked_indexing_and_params_tree():
  w = _w((3, 64, 32))  # [L, In, Out]
  qw = quant.quantize_int4(w, 32)
  assert qw.shape == (3, 64, 32) and qw[1].shape == (64, 32)
  np.testing.assert_array_equal(np.asarray(qw[1].dequantize()), np.asarray(qw.dequantize())[1])
  params = {"embed": _w((50, 64)), "final_norm": np.ones(64, np.float32),
            "layers": {"attn_norm": np.ones((3, 64), np.float32), "wq": w}}
  qp = quant.quantize_params(params, "int8")
  assert quant.is_quantized(qp["layers"]["wq"]) and quant.is_quantized(qp["embed"])
  assert not quant.is_quantized(qp["layers"]["attn_norm"])
  dev = quant.put_params(qp, jnp.bfloat16)
  assert dev["layers"]["wq"].q.dtype == jnp.int8 and dev["final_norm"].dtype == jnp.bfloat16
  assert quant.quantize_params(qp, "int8")["layers"]["wq"] is qp["layers"]["wq"]


@pytest.mark.parametrize("dtype,bound", [("int8", 0.01), ("fp8", 0.05)])
def test_kv_rows_round_trip(dtype, bound):
  x = jnp.asarray(RNG.standard_normal((7, 3, 64)).astype(np.float32))
  x = x.at[2, 1].set(0.0)  # an all-zero row must stay zero (no 0/0)
  stored = kv_cache.quantize_rows(x, dtype)
  assert stored.shape == (7, 3, 64 + kv_cache.SCALE_BYTES) and stored.dtype == jnp.uint8
  back = kv_cache.dequantize_rows(stored, dtype)
  err = float(jnp.sqrt(jnp.mean((back - x) ** 2) / jnp.mean(x ** 2)))
  assert err < bound and bool(jnp.all(back[2, 1] == 0))
