"""Tests for serving.runner.weights: which transformations `prepare_weights` applies for
which engine config, the refusals it raises before touching the params, and `place()`.

Random params of a tiny model, no compile. The mesh cases run in a subprocess on four
CPU devices (the main process has one): `python test_weights.py` prints one JSON line.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from server_procs import xla_flags

import kernels_cpu
from checkpoints import quantizers
from serving.config import EngineConfig
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig
from serving.models.quantized import QuantizedWeight, is_quantized
from serving.runner.weights import PreparedWeights, prepare_weights

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=4, num_kv_heads=1, head_dim=16)
DRAFT_CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda shape: (rng.standard_normal(shape) * 0.05).astype(np.float32),
                      param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=20,
              max_num_batched_tokens=32, compilation_cache=False, unroll_layers=False,
              cpu_activation_bits=32)
  return EngineConfig.of(**{**base, **kw})


def layer(weights: PreparedWeights, i: int = 0) -> dict:
  layers = weights.params["layers"]
  return layers[i] if isinstance(layers, list) else jax.tree.map(
      lambda a: a[i], layers, is_leaf=is_quantized)


def test_float_params_stay_as_loaded_with_scanned_layers():
  params = random_params(CFG)
  w = prepare_weights(params, CFG, engine_config())
  assert w.placement is None and w.mesh is None and w.draft is None
  assert w.model_cfg is CFG and w.source_cfg is CFG
  assert (w.dtype, w.kv_dtype, w.weight_dtype) == ("float32", "float32", "float32")
  assert w.params["layers"]["wq"] is params["layers"]["wq"]  # stacked, untouched
  assert not any(is_quantized(x) for x in jax.tree.leaves(w.params, is_leaf=is_quantized))


@pytest.mark.parametrize("unroll", [True, None])  # None: unrolled on CPU
def test_unrolled_layers_are_unstacked(unroll):
  params = random_params(CFG)
  w = prepare_weights(params, CFG, engine_config(unroll_layers=unroll))
  assert isinstance(w.params["layers"], list) and len(w.params["layers"]) == CFG.num_layers
  np.testing.assert_array_equal(w.params["layers"][2]["w_up"], params["layers"]["w_up"][2])


def test_dtypes_resolve_auto():
  w = prepare_weights(random_params(CFG), CFG,
                      engine_config(dtype="bfloat16", kv_cache_dtype="int8"))
  assert (w.dtype, w.kv_dtype, w.weight_dtype) == ("bfloat16", "int8", "bfloat16")
  w = prepare_weights(random_params(CFG), CFG, engine_config(weight_dtype="bfloat16"))
  assert (w.dtype, w.kv_dtype, w.weight_dtype) == ("float32", "float32", "bfloat16")


def test_quantization_replaces_linears_only():
  w = prepare_weights(random_params(CFG), CFG, engine_config(quantization="int8"))
  lp = layer(w)
  for name in LINEARS:
    assert isinstance(lp[name], QuantizedWeight) and lp[name].kind == "int8", name
    assert lp[name].full is None and lp[name].activation_bits == 32, name
  assert not is_quantized(lp["attn_norm"]) and not is_quantized(w.params["final_norm"])
  assert isinstance(w.params["lm_head"], QuantizedWeight)


@pytest.mark.parametrize("bits", [8, 16])
def test_activation_bits_mark_native_quantized_weights(bits):
  """Nibbles in groups of 32 (here pre-quantized, as a GGUF Q4_0 or converted checkpoint
  arrives) take the bits; the host's int8 (with offsets) and float weights do not."""
  nibbles = quantizers.quantize_params(random_params(CFG), "int4", group_size=32)
  w = prepare_weights(nibbles, CFG, engine_config(cpu_activation_bits=bits,
                                                  quantized_dense_copy=True))
  assert {layer(w)[name].activation_bits for name in LINEARS} == {bits}
  assert all(layer(w)[name].full is not None for name in LINEARS)  # not so on a mesh
  w = prepare_weights(random_params(CFG), CFG,
                      engine_config(quantization="int8", cpu_activation_bits=bits))
  assert {layer(w)[name].activation_bits for name in LINEARS} == {32}
  unquantized = prepare_weights(random_params(CFG), CFG, engine_config(cpu_activation_bits=bits))
  assert not any(is_quantized(x) for x in jax.tree.leaves(unquantized.params,
                                                          is_leaf=is_quantized))


def test_column_tiles_on_one_device_where_the_tiles_run(monkeypatch):
  """Nibbles with integer activations (as a GGUF Q4_0 arrives) take the column-tiled layout
  by default where the native tiles run (AVX-512 VNNI, with or without AMX); not with
  cpu_weight_tiles=False, with float activations, or where the tiles do not run (the mesh
  case: _mesh_worker)."""
  nibbles = quantizers.quantize_params(random_params(CFG), "int4", group_size=32)
  layouts = lambda ec: {layer(prepare_weights(nibbles, CFG, ec))[n].layout  # noqa: E731
                        for n in LINEARS}
  monkeypatch.setattr(kernels_cpu.matvec, "tiles", lambda: True)
  assert layouts(engine_config(cpu_activation_bits=16)) == {"tiles"}
  assert layouts(engine_config(cpu_activation_bits=16, cpu_weight_tiles=False)) == {"rows"}
  assert layouts(engine_config(cpu_activation_bits=32)) == {"rows"}
  monkeypatch.setattr(kernels_cpu.matvec, "tiles", lambda: False)
  assert layouts(engine_config(cpu_activation_bits=16)) == {"rows"}


def test_dense_copy_is_added_as_the_weight_dtype():
  ec = engine_config(quantization="int8", quantized_dense_copy=True, weight_dtype="bfloat16",
                     unroll_layers=True)
  w = prepare_weights(random_params(CFG), CFG, ec)
  wq = w.params["layers"][0]["wq"]
  assert wq.full is not None and wq.full.dtype == jnp.bfloat16
  assert wq.full.shape == (CFG.num_heads * CFG.head_dim, CFG.hidden_size)  # [Out, In]
  np.testing.assert_allclose(np.asarray(wq.full, np.float32), np.asarray(wq.dequantize()),
                             rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("unroll", [True, False])
def test_draft_is_prepared_like_the_target(unroll):
  draft_params = random_params(DRAFT_CFG, seed=1)
  ec = engine_config(speculative_method="draft", speculative_model="draft-dir",
                     unroll_layers=unroll)
  w = prepare_weights(random_params(CFG), CFG, ec, draft=(draft_params, DRAFT_CFG))
  assert w.draft.config is DRAFT_CFG
  assert isinstance(w.draft.params["layers"], list) is unroll
  assert isinstance(w.params["layers"], list) is unroll


def test_draft_refusals_come_first():
  """Raised before the params are looked at: `{}` is no params tree."""
  ec = engine_config(speculative_method="draft", speculative_model="draft-dir")
  with pytest.raises(ValueError, match="exactly when speculative_method='draft'"):
    prepare_weights({}, CFG, ec)
  with pytest.raises(ValueError, match="exactly when speculative_method='draft'"):
    prepare_weights({}, CFG, engine_config(), draft=({}, DRAFT_CFG))
  wide = ModelConfig(**{**DRAFT_CFG.__dict__, "vocab_size": CFG.vocab_size + 1})
  with pytest.raises(ValueError, match="vocabulary"):
    prepare_weights(random_params(CFG), CFG, ec, draft=(random_params(wide), wide))


def test_place_puts_float_and_quantized_leaves_on_the_device():
  w = prepare_weights(random_params(CFG), CFG,
                      engine_config(quantization="int8", weight_dtype="bfloat16"))
  placed = w.place()
  assert isinstance(placed["final_norm"], jax.Array) and placed["final_norm"].dtype == jnp.bfloat16
  wq = placed["layers"]["wq"]
  assert isinstance(wq.q, jax.Array) and wq.q.dtype == w.params["layers"]["wq"].q.dtype
  with pytest.raises(ValueError, match="no draft model"):
    w.place_draft()


def test_on_a_mesh():
  """tp=2 / pp=2 meshes (subprocess, four devices): the refusals, the adapted config, the
  one-device-only transformations left out, stacked layers across pipeline stages."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{REPO}:{REPO}/tests",
         "XLA_FLAGS": xla_flags(4)}
  proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                        text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["draft_on_mesh"].startswith("NotImplementedError: a draft model on a mesh")
  assert got["lora_with_pp"].startswith("NotImplementedError: LoRA adapters with pipeline")
  assert got["tp"] == dict(kv_heads=2, source_kv_heads=1, unrolled=True, wk_out=2 * 16,
                           mesh={"tp": 2}, wq_spec="P(None, 'tp')")  # [In, Out]: out split
  assert got["tp_quantized"] == dict(full=[], activation_bits=[32], layouts=["rows"])
  assert got["pp"] == dict(num_layers=4, source_layers=3, stacked_layers=4)


def _mesh_worker() -> dict:
  """The mesh cases of `test_on_a_mesh`, on four CPU devices."""
  def refusal(draft=None, **kw) -> str:
    try:
      prepare_weights({}, CFG, engine_config(**kw), draft=draft)
    except NotImplementedError as e:
      return f"NotImplementedError: {e}"
    return "nothing raised"

  out = {"draft_on_mesh": refusal(tp=2, speculative_method="draft", speculative_model="d",
                                  draft=({}, DRAFT_CFG)),
         "lora_with_pp": refusal(pp=2, max_loras=1)}
  w = prepare_weights(random_params(CFG), CFG, engine_config(tp=2, unroll_layers=True))
  out["tp"] = dict(kv_heads=w.model_cfg.num_kv_heads, source_kv_heads=w.source_cfg.num_kv_heads,
                   unrolled=isinstance(w.params["layers"], list),
                   wk_out=w.params["layers"][0]["wk"].shape[-1],
                   mesh={k: v for k, v in w.mesh.shape.items() if v > 1},
                   wq_spec=str(w.place()["layers"][0]["wq"].sharding.spec))
  # What one device would give dense copies and activation bits keeps neither on a mesh.
  nibbles = quantizers.quantize_params(random_params(CFG), "int4", group_size=32)
  ec = engine_config(tp=2, quantized_dense_copy=True, cpu_activation_bits=16)
  lp = layer(prepare_weights(nibbles, CFG, ec))
  out["tp_quantized"] = dict(full=[n for n in LINEARS if lp[n].full is not None],
                             activation_bits=sorted({lp[n].activation_bits for n in LINEARS}),
                             layouts=sorted({lp[n].layout for n in LINEARS}))
  w = prepare_weights(random_params(CFG), CFG, engine_config(pp=2, unroll_layers=True))
  out["pp"] = dict(num_layers=w.model_cfg.num_layers, source_layers=w.source_cfg.num_layers,
                   stacked_layers=w.params["layers"]["wq"].shape[0])
  return out


if __name__ == "__main__":
  print(json.dumps(_mesh_worker()))
