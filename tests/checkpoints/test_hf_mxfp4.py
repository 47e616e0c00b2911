"""A GPT-OSS checkpoint with MXFP4 experts: kept as stored, and the model matches transformers.

The tiny GPT-OSS model's experts are packed to MXFP4 by the test
(tests/mxfp4_testutil.py); transformers runs on its own dequantization of
those blocks; our forward (dense attention callback) runs on the blocks.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from attention_ref import dense_logits
from mxfp4_testutil import save_tiny_mxfp4_model
from safetensors.numpy import load_file, save_file

from checkpoints import load_checkpoint
from serving.models.quantized import QuantizedWeight

LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
  return path, save_tiny_mxfp4_model(path)


def test_experts_kept_as_stored(tiny):
  loaded = load_checkpoint(tiny[0])
  tensors = load_file(os.path.join(tiny[0], "model.safetensors"))
  layers = loaded.params["layers"]
  for key in ("we_gate", "we_up", "we_down"):
    w = layers[key]
    assert isinstance(w, QuantizedWeight) and w.kind == "mxfp4"
  assert layers["we_gate"].shape == (4, 4, 64, 64) and layers["we_down"].shape == (4, 4, 64, 64)
  for i in range(4):
    prefix = f"model.layers.{i}.mlp.experts"
    blocks = tensors[f"{prefix}.gate_up_proj_blocks"]  # [E, 2M, G, 16], gate rows even
    scales = tensors[f"{prefix}.gate_up_proj_scales"]
    np.testing.assert_array_equal(layers["we_gate"].q[i], blocks[:, 0::2].reshape(4, 64, 32))
    np.testing.assert_array_equal(layers["we_up"].scale[i], scales[:, 1::2])
    np.testing.assert_array_equal(layers["we_down"].q[i],
                                  tensors[f"{prefix}.down_proj_blocks"].reshape(4, 64, 32))


def test_forward_matches_transformers_on_dequantized(tiny):
  loaded = load_checkpoint(tiny[0])
  ids = [int(i) for i in np.random.RandomState(2).randint(0, 256, 30)]
  with torch.no_grad():
    want = tiny[1](torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(dense_logits(loaded.params, loaded.config, ids), want,
                             atol=LOGIT_ATOL)


def test_missing_scales_raise(tiny, tmp_path):
  for name in os.listdir(tiny[0]):
    with open(os.path.join(tiny[0], name), "rb") as src, open(tmp_path / name, "wb") as dst:
      dst.write(src.read())
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.layers.2.mlp.experts.down_proj_scales"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="layer 2 scales of we_down"):
    load_checkpoint(str(tmp_path))


def test_mxfp4_on_other_families_raises(tiny, tmp_path):
  from tiny_models import save_tiny_model  # noqa: PLC0415

  save_tiny_model("mixtral", str(tmp_path))
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  config["quantization_config"] = {"quant_method": "mxfp4"}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match="GPT-OSS experts only"):
    load_checkpoint(str(tmp_path))


def test_orbax_round_trip_keeps_mxfp4(tiny, tmp_path):
  from checkpoints import load_orbax, save_orbax  # noqa: PLC0415

  loaded = load_checkpoint(tiny[0])
  back = load_orbax(save_orbax(loaded, str(tmp_path / "orbax")))
  assert back.config == loaded.config  # YaRN scaling, layer types, the SwiGLU limit
  for key in ("we_gate", "we_down"):
    w, got = loaded.params["layers"][key], back.params["layers"][key]
    assert got.kind == "mxfp4" and got.group_size == 32
    np.testing.assert_array_equal(np.asarray(got.q), w.q)
    np.testing.assert_array_equal(np.asarray(got.scale), w.scale)
