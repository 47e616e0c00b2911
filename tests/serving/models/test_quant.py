"""Unit tests of the quantized weight leaf (serving/models/quantized.py), the host
quantizers (checkpoints/quantizers.py), GPTQ (serving/tools/gptq.py) and the quantized
KV cache rows (small, random)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import quantizers
from serving.models import quantized as quant
from serving.runner import kv_cache
from serving.runner.weights import put_params

RNG = np.random.default_rng(0)


def _w(shape=(128, 96)):
  return RNG.standard_normal(shape).astype(np.float32) * 0.05


def _rel_err(w, qw):
  d = np.swapaxes(np.asarray(qw.dequantize()), -1, -2)
  return float(np.sqrt(np.mean((d - w) ** 2) / np.mean(w ** 2)))


@pytest.mark.parametrize("method,kw,bound", [
    ("int8", {}, 0.01), ("int8", dict(group_size=32), 0.01), ("int8", dict(group_size=0), 0.01),
    ("int4", dict(group_size=32), 0.1), ("int4", dict(group_size=64), 0.12),
    ("fp8", {}, 0.05)])
def test_round_trip_error(method, kw, bound):
  w = _w()
  qw = quantizers.quantize_weight(w, method, **kw)
  assert qw.shape == w.shape
  assert _rel_err(w, qw) < bound


def test_symmetric_int4_and_group_fallback():
  w = _w((96, 32))
  assert _rel_err(w, quantizers.quantize_int4(w, 32, asymmetric=False)) < 0.15
  assert quantizers.quantize_weight(w, "int4", group_size=128).group_size == 32  # 96 % 64 != 0


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
  qw = jax.tree.map(jnp.asarray, quantizers.quantize_weight(w, method, **kw))
  dense = np.swapaxes(np.asarray(qw.dequantize()), -1, -2)  # [In, Out]
  x = RNG.standard_normal((rows, w.shape[0])).astype(np.float32)
  out = jax.jit(lambda q, x: q.matmul(x))(qw, x)
  np.testing.assert_allclose(out, x @ dense, rtol=1e-4, atol=1e-4)
  ids = jnp.array([3, 0, 95])
  np.testing.assert_allclose(qw.lookup(ids), dense.T[ids], rtol=1e-6, atol=1e-6)


def test_column_tiled_layout_reads_as_the_stored_rows(monkeypatch):
  """tile_for_native re-lays the linear weights, the head and the embedding it can (Q8_0,
  Q4_0, Q4_1 with integer activations) and nothing else; a tiled weight dequantizes, looks
  up rows and multiplies (native tiles where they run, else the XLA path) as the stored
  one; the layout refuses the kinds its tiles do not read."""
  params = {"embed": quantizers.quantize_int8(_w((64, 96)), 32, asymmetric=False),
            "layers": [{"wq": quantizers.quantize_int4(_w((64, 96)), 32),
                        "wk": quantizers.quantize_int4(_w((64, 40)), 32),  # 40 outputs
                        "wv": quantizers.quantize_int8(_w((64, 96)), 32),  # uint8 + mins
                        "w_up": quantizers.quantize_int4(_w((64, 96)), 32, asymmetric=False)}]}
  params = quant.with_activation_bits(jax.tree.map(jnp.asarray, params), 16)
  tiled = quant.tile_for_native(params)
  layer = tiled["layers"][0]
  assert [tiled["embed"].layout, layer["wq"].layout, layer["wk"].layout, layer["wv"].layout,
          layer["w_up"].layout] == ["tiles", "tiles", "rows", "rows", "tiles"]
  assert quant.tile_for_native({"other": params["layers"][0]["wq"]})["other"].layout == "rows"
  x = RNG.standard_normal((3, 64)).astype(np.float32)
  for name, w in [("embed", params["embed"]), ("wq", params["layers"][0]["wq"]),
                  ("w_up", params["layers"][0]["w_up"])]:
    t = tiled[name] if name == "embed" else layer[name]
    assert not np.array_equal(np.asarray(t.q), np.asarray(w.q))
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(w.dequantize()))
    np.testing.assert_array_equal(np.asarray(t.rows_layout().q), np.asarray(w.q))
    ids = jnp.array([[3, 0], [95, 17]])
    np.testing.assert_array_equal(np.asarray(t.lookup(ids)), np.asarray(w.lookup(ids)))
    matmul = jax.jit(lambda q, x: q.matmul(x))
    np.testing.assert_array_equal(np.asarray(matmul(t, x)), np.asarray(matmul(w, x)))
    with monkeypatch.context() as m:  # no tiles here: the XLA path on the stored rows
      m.setattr(quant.kernels_cpu.matvec, "tiles", lambda: False)
      assert not t.runs_native(3)
      dense = np.swapaxes(np.asarray(w.dequantize()), -1, -2)
      np.testing.assert_allclose(np.asarray(t.matmul(jnp.asarray(x))), x @ dense, rtol=1e-4,
                                 atol=1e-4)
  kquant_like = dataclasses.replace(params["layers"][0]["wq"], activation_bits=32)
  with pytest.raises(ValueError, match="column-tiled layout"):
    dataclasses.replace(kquant_like, layout="tiles")
  with pytest.raises(ValueError, match="layout="):
    dataclasses.replace(kquant_like, layout="columns")


def test_stacked_indexing_and_params_tree():
  w = _w((3, 64, 32))  # [L, In, Out]
  qw = quantizers.quantize_int4(w, 32)
  assert qw.shape == (3, 64, 32) and qw[1].shape == (64, 32)
  np.testing.assert_array_equal(np.asarray(qw[1].dequantize()), np.asarray(qw.dequantize())[1])
  params = {"embed": _w((50, 64)), "final_norm": np.ones(64, np.float32),
            "layers": {"attn_norm": np.ones((3, 64), np.float32), "wq": w}}
  qp = quantizers.quantize_params(params, "int8")
  assert quant.is_quantized(qp["layers"]["wq"]) and quant.is_quantized(qp["embed"])
  assert not quant.is_quantized(qp["layers"]["attn_norm"])
  dev = put_params(qp, jnp.bfloat16)
  assert dev["layers"]["wq"].q.dtype == jnp.uint8 and dev["final_norm"].dtype == jnp.bfloat16
  assert quantizers.quantize_params(qp, "int8")["layers"]["wq"] is qp["layers"]["wq"]


@pytest.mark.parametrize("dtype,bound", [("int8", 0.01), ("fp8", 0.05)])
def test_kv_rows_round_trip(dtype, bound):
  x = jnp.asarray(RNG.standard_normal((7, 3, 64)).astype(np.float32))
  x = x.at[2, 1].set(0.0)  # an all-zero row must stay zero (no 0/0)
  stored = kv_cache.quantize_rows(x, dtype)
  assert stored.shape == (7, 3, 64 + kv_cache.SCALE_BYTES) and stored.dtype == jnp.uint8
  back = kv_cache.dequantize_rows(stored, dtype)
  err = float(jnp.sqrt(jnp.mean((back - x) ** 2) / jnp.mean(x ** 2)))
  assert err < bound and bool(jnp.all(back[2, 1] == 0))


# ---- GPTQ (serving/tools/gptq.py) against a pure-numpy reference ----


def _numpy_gptq(w_rows, hess, g, damp, shrink, refine):
  """Textbook GPTQ in float64: H^-1's upper Cholesky factor, columns in group order, each
  group's (scale, min) fitted on its error-updated weights with cost 1 / U_jj^2."""
  w = w_rows.astype(np.float64).copy()
  o, i = w.shape
  h = (1 - shrink) * hess + shrink * np.diag(np.diag(hess))
  h = h + damp * np.mean(np.diag(hess)) * np.eye(i)
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  deq = np.zeros_like(w)
  for start in range(0, i, g):
    cost = 1.0 / np.diag(u)[start:start + g] ** 2
    scale, off = quantizers.fit_min_scale(w[:, None, start:start + g], refine, weights=cost)
    scale, off = scale.astype(np.float64)[:, 0], off.astype(np.float64)[:, 0]
    for j in range(start, start + g):
      q = np.clip(np.rint((w[:, j] - off) / np.where(scale == 0, 1, scale)), 0, 15)
      deq[:, j] = q * scale + off
      err = (w[:, j] - deq[:, j]) / u[j, j]
      w[:, j:] -= np.outer(err, u[j, j:])
  return deq


def _correlated_inputs(n, dim, seed):
  """Inputs with a few large channels and correlated directions (like LLM activations)."""
  rng = np.random.default_rng(seed)
  mix = np.random.default_rng(99).standard_normal((dim, dim)) / np.sqrt(dim)
  scale = np.ones(dim)
  scale[:3] = 8.0
  return (rng.standard_normal((n, dim)) @ (np.eye(dim) + mix)) * scale


def _proxy_loss(w_rows, deq_rows, x):
  """||x (W_q - W)^T||^2 / n: the output error that GPTQ minimises."""
  return float(np.mean(np.sum((x @ (deq_rows - w_rows).T) ** 2, axis=1)))


def test_hessian_inverse_factor_matches_numpy():
  from serving.tools import gptq as qc
  x = _correlated_inputs(300, 96, 0)
  hess = x.T @ x / len(x)
  u, dead = qc.hessian_inverse_factor(hess, 0.1, 0.3)
  h = 0.7 * hess + 0.3 * np.diag(np.diag(hess)) + 0.1 * np.mean(np.diag(hess)) * np.eye(96)
  np.testing.assert_allclose(u, np.linalg.cholesky(np.linalg.inv(h)).T, rtol=1e-3, atol=1e-5)
  assert not dead.any()
  hess[5, :] = hess[:, 5] = 0  # an input never seen: its weights are zeroed, H stays invertible
  u, dead = qc.hessian_inverse_factor(hess, 0.1, 0.3)
  assert dead[5] and dead.sum() == 1 and np.isfinite(u).all()


def test_gptq_matches_numpy_reference_and_beats_rounding():
  from serving.tools import gptq as qc
  w = RNG.standard_normal((128, 24)).astype(np.float32) * 0.05  # [In, Out]
  rows = w.T.astype(np.float64)
  x_cal, x_test = _correlated_inputs(400, 128, 1), _correlated_inputs(400, 128, 2)
  hess = x_cal.T @ x_cal / len(x_cal)
  qw = qc.gptq_int4(w, hess, 32, damp=0.1, shrink=0.3, refine=4)
  assert (qw.kind, qw.group_size, qw.shape) == ("int4", 32, (128, 24))
  ours = np.asarray(qw.dequantize(), np.float64)  # [Out, In]
  ref = _numpy_gptq(rows, hess, 32, 0.1, 0.3, 4)
  # float32 vs float64 can flip a rounding and its feedback; nearly all values agree.
  assert np.mean(np.isclose(ours, ref, rtol=0, atol=1e-3)) > 0.95
  rtn = np.asarray(quantizers.quantize_int4(w, 32).dequantize(), np.float64)
  for x in (x_cal, x_test):  # on the calibration inputs and on unseen ones
    loss_ours, loss_ref = _proxy_loss(rows, ours, x), _proxy_loss(rows, ref, x)
    assert abs(loss_ours - loss_ref) < 0.05 * loss_ref
    assert loss_ours < 0.7 * _proxy_loss(rows, rtn, x)


def test_weighted_group_fit():
  """The (scale, min) fit with per-element costs: uniform costs change nothing, a heavy
  cost on one element makes that element (nearly) exact."""
  grouped = RNG.standard_normal((40, 1, 32)).astype(np.float32)
  plain = quantizers.fit_min_scale(grouped, 4)
  uniform = quantizers.fit_min_scale(grouped, 4, weights=np.ones(32))
  np.testing.assert_allclose(np.float32(plain[0]), np.float32(uniform[0]), rtol=2e-3)

  def err(scale, off, k):
    s, o = scale.astype(np.float32)[..., None], off.astype(np.float32)[..., None]
    deq = np.clip(np.rint((grouped - o) / s), 0, 15) * s + o
    return np.abs(deq - grouped)[..., k]

  cost = np.ones(32)
  cost[7] = 1e4
  assert np.mean(err(*quantizers.fit_min_scale(grouped, 4, weights=cost), 7)) < 0.5 * np.mean(
      err(*plain, 7))


def test_value_hessian_is_attention_weighted():
  """wv's statistic: per KV head, sum over queries and heads of y y^T, y_t = sum_s p_ts x_s."""
  from serving.models.model_config import ModelConfig
  from serving.tools import gptq as qc
  cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4)
  t = 6
  q, k, v = (jnp.asarray(RNG.standard_normal((t, n, 4)), jnp.float32) for n in (4, 2, 2))
  x = RNG.standard_normal((t, 8)).astype(np.float32)
  stats = {"_v_in": jnp.asarray(x)}
  out, _ = qc._dense_attend(cfg, stats, 0, q, k, v, None)
  s = np.einsum("tnh,snh->nts", np.asarray(q), np.repeat(np.asarray(k), 2, axis=1)) / 2.0
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)  # [N, T, S]
  np.testing.assert_allclose(out, np.einsum("nts,snh->tnh", p, np.repeat(np.asarray(v), 2, 1)),
                             rtol=1e-5, atol=1e-5)
  y = np.einsum("nts,sd->ntd", p, x)
  want = np.stack([np.einsum("ntd,nte->de", y[2 * j:2 * j + 2], y[2 * j:2 * j + 2])
                   for j in range(2)])
  np.testing.assert_allclose(stats["v"], want, rtol=1e-4, atol=1e-4)
  assert "_v_in" not in stats


def _tiny_llama(stacked: bool):
  from serving.models.model_config import ModelConfig
  cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, bos_token_id=1,
                    tie_word_embeddings=True)
  rng = np.random.default_rng(3)
  f = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-2])).astype(np.float32)
  one = lambda: {"attn_norm": np.ones(64, np.float32), "mlp_norm": np.ones(64, np.float32),
                 "wq": f(64, 64), "wk": f(64, 32), "wv": f(64, 32), "wo": f(64, 64),
                 "w_gate": f(64, 128), "w_up": f(64, 128), "w_down": f(128, 64)}
  layers = [one() for _ in range(2)]
  if stacked:
    layers = {k: np.stack([lp[k] for lp in layers]) for k in layers[0]}
  params = {"embed": rng.standard_normal((64, 64)).astype(np.float32),
            "final_norm": np.ones(64, np.float32), "layers": layers}
  return cfg, params


@pytest.mark.parametrize("stacked", [True, False])
def test_gptq_quantize_params_tiny_model(stacked):
  """All dense linears become int4 g32 (GPTQ), the tied head int8; the model's output on
  the calibration tokens is closer to float than with rounding."""
  from serving.models import causal_lm
  from serving.tools import gptq as qc
  cfg, params = _tiny_llama(stacked)

  class Tok:
    encode = staticmethod(lambda text, add_special_tokens=False: [ord(c) % 62 + 2 for c in text])

  cal = qc.Calibration.from_text(cfg, Tok(), "calibration text. " * 60, seq_len=128,
                                 max_sequences=4)
  assert cal.sequences.shape == (4, 128) and (cal.sequences[:, 0] == 1).all()
  qp = qc.gptq_quantize_params(params, cal, group_size=32)
  rtn = quantizers.quantize_params(params, "int4", group_size=32)
  leaves = qp["layers"] if stacked else qp["layers"][1]
  for k in quant.LINEAR_KEYS:
    assert (leaves[k].kind, leaves[k].group_size) == ("int4", 32), k
    assert leaves[k].shape == np.shape((params["layers"] if stacked else params["layers"][1])[k])
  assert qp["embed"].kind == "int8"
  assert qc.gptq_quantize_params(qp, cal)["layers"] is not None  # no-op

  def hidden(p):
    attend = functools.partial(qc._dense_attend, cfg, None)
    return np.concatenate([np.asarray(causal_lm.forward(p, cfg, jnp.asarray(s), jnp.arange(128),
                                                    None, attend)[0]) for s in cal.sequences])

  ref = hidden(params)
  err = lambda p: float(np.mean((hidden(p) - ref) ** 2))
  assert err(qp) < 0.8 * err(rtn)


def test_weight_formats_line():
  """What the start-up line says about the weights in force."""
  w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
  params = {"embed": w, "layers": {"wq": quantizers.quantize_weight(w, "int8"),
                                   "wo": quantizers.quantize_weight(w, "int4", group_size=32)}}
  assert quant.weight_formats(params, "bfloat16") == "int4 g32 + int8 g32; other weights bfloat16"
  assert quant.weight_formats({"embed": w}, "float32") == "float32"


def test_int8_groups_hold_a_coarser_grid():
  """Asymmetric int8 groups (the default) contain any 16-level min + scale grid of
  their group (e.g. weights from a Q4_1 file) to float16 precision; symmetric
  Q8_0-style codes do not."""
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 16, (8, 64)).astype(np.float32)
  codes[:, ::32] = 0  # every group spans its whole grid
  codes[:, 1::32] = 15
  grid = codes * 0.013 - 0.1
  asym = quantizers.quantize_int8(grid, 32, transpose=False)
  sym = quantizers.quantize_int8(grid, 32, asymmetric=False, transpose=False)
  err = lambda qw: np.abs(np.asarray(qw.dequantize()) - grid).max()
  assert asym.q.dtype == np.uint8 and asym.offset is not None
  assert err(asym) < 2e-4 < err(sym)
