"""Gemma 2 / Gemma 3 config parsing: both key styles, the defaults, and what we refuse."""

import json

import pytest
import transformers

from checkpoints.orbax_io import config_from_dict, config_to_dict
from serving.models.model_config import LinearRopeScaling, ModelConfig

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)

# A Gemma 3 config.json as the hub's transformers-4 checkpoints have it (gemma-3-4b text part).
LEGACY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **SMALL,
    "num_hidden_layers": 12, "rope_theta": 2e6, "rope_local_base_freq": 20000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
    "eos_token_id": [1, 106], "bos_token_id": 2,
}


def _hf(config: transformers.PreTrainedConfig) -> dict:
  """The config.json transformers writes (what a transformers-5 checkpoint holds)."""
  return json.loads(config.to_json_string())


def test_gemma3_legacy_and_current_keys_agree():
  legacy = ModelConfig.from_hf_config(LEGACY_GEMMA3)
  current = ModelConfig.from_hf_config(_hf(transformers.Gemma3TextConfig(**{
      k: v for k, v in LEGACY_GEMMA3.items() if k not in ("architectures", "model_type")})))
  assert legacy == current
  assert legacy.family == "gemma" and legacy.qk_norm and legacy.tie_word_embeddings
  assert legacy.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
  assert [legacy.layer_window(i) for i in (0, 4, 5, 11)] == [1024, 1024, None, None]
  assert legacy.rope_theta == 2e6 and legacy.rope_scaling == LinearRopeScaling(8.0)
  assert legacy.local_rope_theta == 20000.0 and legacy.attn_scale == 256 ** -0.5
  assert legacy.final_soft_cap is None and legacy.eos_token_ids == (1, 106)


def test_gemma2_defaults_as_transformers():
  raw = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **SMALL,
         "num_hidden_layers": 4, "query_pre_attn_scalar": 144}
  cfg = ModelConfig.from_hf_config(raw)
  ref = transformers.Gemma2Config(**SMALL, num_hidden_layers=4, query_pre_attn_scalar=144)
  assert cfg.layer_types == tuple(ref.layer_types)
  assert cfg.attn_soft_cap == ref.attn_logit_softcapping == 50.0
  assert cfg.final_soft_cap == ref.final_logit_softcapping == 30.0
  assert cfg.sliding_window == ref.sliding_window and cfg.attn_scale == 144 ** -0.5
  assert not cfg.qk_norm and cfg.local_rope_theta is None and cfg.rope_scaling is None
  assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
  assert cfg == ModelConfig.from_hf_config(_hf(ref))


def test_gemma3_ignores_attention_soft_cap_like_transformers():
  """Gemma3Attention passes no softcap to its attention, whatever the config says."""
  cfg = ModelConfig.from_hf_config({**LEGACY_GEMMA3, "attn_logit_softcapping": 50.0,
                                 "final_logit_softcapping": 30.0})
  assert cfg.attn_soft_cap is None and cfg.final_soft_cap == 30.0


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["sliding_attention"] * 11 + ["chunked_attention"]}, "chunked_attention"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "'yarn'"),
    ({"hidden_activation": "relu"}, "'relu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding-layer"),
])
def test_unsupported_gemma_configs_raise(change, message):
  with pytest.raises(ValueError, match=message) as e:
    ModelConfig.from_hf_config({**LEGACY_GEMMA3, **change})
  assert "supported" in str(e.value)


def test_gemma_config_survives_our_checkpoint_format():
  cfg = ModelConfig.from_hf_config(LEGACY_GEMMA3)
  assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
