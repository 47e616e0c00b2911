"""Quantized checkpoints: GGUF blocks as QuantizedWeights, orbax round trip, convert."""

import gguf
import numpy as np
import pytest
from ckpt_testutil import tiny_model

from checkpoints import gguf as gguf_io
from checkpoints import load_hf_dir, load_orbax, load_quantized, quantizers, save_orbax
from checkpoints.layout import LoadedModel
from checkpoints.quantize import gguf_quantized_weight
from serving.models import quantized as quant

Q = gguf.GGMLQuantizationType


def _as_linear(qw):
  """A QuantizedWeight's logical [In, Out] matrix (numpy float32)."""
  return np.swapaxes(np.asarray(qw.dequantize()), -1, -2)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_types_match_gguf_dequantization(qtype):
  w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)  # [Out, In]
  blocks = gguf.quants.quantize(w, qtype)
  raw = gguf_io.RawTensor(name="blk.0.ffn_up.weight", ggml_type=qtype, shape=w.shape,
                          data=blocks)
  qw = gguf_quantized_weight(raw)
  assert qw.group_size == 32 and qw.kind == ("int8" if qtype == Q.Q8_0 else "int4")
  assert (qw.offset is not None) == (qtype == Q.Q4_1)
  assert qw.nbytes <= blocks.nbytes  # the blocks' own bytes, no float copy
  want = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
  np.testing.assert_array_equal(np.asarray(qw.dequantize()), want)


def test_smollm_blocks_kept(smollm_path, smollm):
  """Q4_1 layers (Q/K un-permuted) and the Q8_0 tied embedding equal the float load."""
  loaded = load_quantized(smollm_path, "int4")
  layers = loaded.params["layers"]
  for key in ("wq", "wk", "w_down"):
    assert layers[key].kind == "int4" and layers[key].q.shape[0] == smollm.config.num_layers
    np.testing.assert_array_equal(_as_linear(layers[key][1]), smollm.params["layers"][key][1])
  emb = loaded.params["embed"]
  np.testing.assert_array_equal(np.asarray(emb.dequantize()), smollm.params["embed"])
  # int8 keeps only Q8_0 tensors: the Q4_1 layers stay float for the runner to quantize.
  int8 = load_quantized(smollm_path, "int8")
  assert not quant.is_quantized(int8.params["layers"]["wq"])
  assert quant.is_quantized(int8.params["embed"])


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_orbax_round_trip_quantized(method, tmp_path):
  path = tmp_path / "hf"
  tiny_model("llama").save_pretrained(path)
  loaded = load_hf_dir(str(path))
  params = quantizers.quantize_params(loaded.params, method, group_size=32)
  save_orbax(LoadedModel(config=loaded.config, params=params, tokenizer=None,
                         source=loaded.source), str(tmp_path / "ckpt"))
  back = load_orbax(str(tmp_path / "ckpt"), dtype="bfloat16")
  for key in ("wq", "w_down"):
    a, b = params["layers"][key], back.params["layers"][key]
    assert quant.is_quantized(b) and (b.kind, b.group_size) == (a.kind, a.group_size)
    for f in ("q", "scale", "offset"):
      x, y = getattr(a, f), getattr(b, f)
      assert (x is None) == (y is None)
      if x is not None:
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  assert str(back.params["final_norm"].dtype) == "bfloat16"
