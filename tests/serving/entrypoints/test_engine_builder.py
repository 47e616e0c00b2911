"""`check_setup`: input `build_engine` cannot serve fails with `SetupError` before anything
loads (a directory holding only a config.json stands in for the model, so any load would
fail differently): a model that cannot be found or read, a draft model likewise, a layout
needing more devices than are visible, a draft model with prefill / decode workers."""

import json

import jax
import pytest

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine, check_model, check_setup
from serving.entrypoints.startup import SetupError

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
SMALL = dict(max_num_seqs=2, max_model_len=128, num_pages=32)


@pytest.fixture
def config_only(tmp_path):
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
  return str(tmp_path / "model")


def test_a_servable_setup_passes(config_only):
  check_setup(config_only, EngineConfig.of(**SMALL))


def test_models_that_cannot_load(tmp_path, config_only):
  with pytest.raises(SetupError, match="is not a preset"):
    build_engine(str(tmp_path / "missing"), EngineConfig.of(**SMALL))
  (tmp_path / "empty").mkdir()
  with pytest.raises(SetupError, match="unsupported model directory"):
    check_model(str(tmp_path / "empty"))
  draft = EngineConfig.of(**SMALL, speculative_method="draft",
                       speculative_model=str(tmp_path / "no-draft"))
  with pytest.raises(SetupError, match="no-draft"):
    check_setup(config_only, draft)


def test_too_few_devices(config_only):
  n = len(jax.devices())
  with pytest.raises(SetupError, match=f"needs {n + 1} devices but only {n} are visible"):
    build_engine(config_only, EngineConfig.of(**SMALL, tp=n + 1))
  with pytest.raises(SetupError, match=f"need {2 * (n + 1)} devices"):
    check_setup(config_only, EngineConfig.of(**SMALL, tp=n + 1, dp=2))


def test_draft_model_with_workers(config_only):
  config = EngineConfig.of(**SMALL, prefill_workers=1, decode_workers=1,
                        speculative_method="draft", speculative_model=config_only)
  with pytest.raises(SetupError, match="prefill / decode workers"):
    check_setup(config_only, config)
  assert issubclass(SetupError, ValueError)  # callers catching ValueError still do


def test_auto_quantization_keeps_gguf_blocks(config_only):
  """The default `quantization="auto"`: a GGUF file is served from its blocks (one set of
  weights for every batch), any other checkpoint as loaded; an explicit choice stays."""
  from checkpoints import presets
  from serving.entrypoints.engine_builder import load_method

  try:
    smollm_path = presets.resolve_preset("smollm2-135m-instruct")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  assert EngineConfig().model.quantization == "auto"
  assert load_method(smollm_path, "auto") == "gguf"
  assert load_method(config_only, "auto") is None
  assert load_method(smollm_path, None) is None  # --quantization=none: dequantized
  assert load_method(config_only, "int8") == "int8"
