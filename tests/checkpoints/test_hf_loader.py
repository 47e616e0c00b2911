"""HF directories: tiny random transformers models saved as safetensors load exactly."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from ckpt_testutil import assert_params_equal, expected_params, tiny_model

from checkpoints import hf, load_checkpoint
from serving.models.layout import param_shapes


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral",
                                        "qwen3_moe"])
def test_single_file_matches_torch(tmp_path, model_type):
  model = tiny_model(model_type)
  model.save_pretrained(tmp_path)
  loaded = load_checkpoint(str(tmp_path))
  assert loaded.config.model_type == model_type
  assert loaded.tokenizer is None  # no tokenizer files in the directory
  assert_params_equal(loaded.params, expected_params(model))
  shapes = param_shapes(loaded.config)
  assert shapes["layers"].keys() == loaded.params["layers"].keys()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_sharded_matches_torch(tmp_path, model_type):
  model = tiny_model(model_type, seed=1)
  model.save_pretrained(tmp_path, max_shard_size="40KB")
  shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
  assert len(shards) > 2 and os.path.exists(tmp_path / "model.safetensors.index.json")
  assert_params_equal(load_checkpoint(str(tmp_path)).params, expected_params(model))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_fused_expert_layout(tmp_path, model_type):
  """transformers 5's in-memory names (experts.gate_up_proj / down_proj) load too."""
  model = tiny_model(model_type, seed=2)
  model.save_pretrained(tmp_path, save_original_format=False)
  with open(tmp_path / "model.safetensors", "rb") as f:
    header = f.read(20000)
  assert b"experts.gate_up_proj" in header
  assert_params_equal(load_checkpoint(str(tmp_path)).params, expected_params(model))


def test_tied_embeddings_and_generation_eos(tmp_path):
  model = tiny_model("llama", tie_word_embeddings=True, eos_token_id=2)
  model.save_pretrained(tmp_path)
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [2, 7, 9]}, f)
  loaded = load_checkpoint(str(tmp_path))
  assert "lm_head" not in loaded.params
  assert loaded.config.tie_word_embeddings
  assert loaded.config.eos_token_ids == (2, 7, 9)
  assert_params_equal(loaded.params, expected_params(model))


def test_bfloat16(tmp_path):
  model = tiny_model("qwen2")
  model.save_pretrained(tmp_path)
  loaded = load_checkpoint(str(tmp_path), dtype="bfloat16")
  assert loaded.params["layers"]["wq"].dtype == ml_dtypes.bfloat16
  want = expected_params(model)["layers"]["wq"].astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(loaded.params["layers"]["wq"], want)


def test_auto_dtype_follows_config(tmp_path):
  import torch
  model = tiny_model("llama")
  model.to(torch.bfloat16).save_pretrained(tmp_path)
  loaded = load_checkpoint(str(tmp_path), dtype="auto")
  assert loaded.params["embed"].dtype == ml_dtypes.bfloat16
  assert load_checkpoint(str(tmp_path)).params["embed"].dtype == np.float32


def test_tokenizer_from_dir(tmp_path, smollm):
  model = tiny_model("llama", vocab_size=smollm.config.vocab_size)
  model.save_pretrained(tmp_path)
  smollm.tokenizer.save(str(tmp_path))
  loaded = load_checkpoint(str(tmp_path))
  text = "Hello, 세계! 🙂"
  assert loaded.tokenizer.encode(text) == smollm.tokenizer.encode(text)
  assert set(loaded.config.eos_token_ids) >= {2, 0}  # <|im_end|>, <|endoftext|>


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
  with pytest.raises(ValueError, match="gpt2"):
    load_checkpoint(str(tmp_path))


def test_unsupported_dtype_and_format(tmp_path):
  model = tiny_model("llama")
  model.save_pretrained(tmp_path)
  with pytest.raises(ValueError, match="float16"):
    load_checkpoint(str(tmp_path), dtype=np.float16)
  os.remove(tmp_path / "model.safetensors")
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(ValueError, match=r"\.bin"):
    load_checkpoint(str(tmp_path))


def test_unknown_tensor_is_an_error(tmp_path):
  from safetensors.numpy import save_file
  model = tiny_model("llama")
  model.save_pretrained(tmp_path)
  save_file({"model.layers.0.mlp.mystery.weight": np.zeros((2, 2), np.float32)},
            str(tmp_path / "model.safetensors"))
  _, cfg = hf.load_hf_config(str(tmp_path))
  with pytest.raises(ValueError, match="mystery"):
    hf.load_hf_params(str(tmp_path), cfg)
