"""Phi-3 config parsing and rotary math against transformers' own (no engine).

Configs shaped like the published checkpoints' config.json files (Phi-3-mini-4k:
plain RoPE, a 2047 window; Phi-3-mini-128k: "su"/"longrope" with a top-level
original context; Phi-4-mini: 3/4 of each head rotated, tied embeddings), and
the inverse frequencies / attention factor transformers computes for them.
"""

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from checkpoints.orbax_io import config_from_dict, config_to_dict
from serving.models import layers, phi3
from serving.models.model_config import LongRopeScaling, ModelConfig, RopeScaling

_BASE = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064,
             hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=32000, hidden_act="silu")


def _factors(n: int, top: float) -> list[float]:
  return np.linspace(1.0, top, n).round(4).tolist()


PHI3_MINI_4K = {**_BASE, "max_position_embeddings": 4096,
                "original_max_position_embeddings": 4096, "sliding_window": 2047,
                "rope_scaling": None}
PHI3_MINI_128K = {**_BASE, "max_position_embeddings": 131072,
                  "original_max_position_embeddings": 4096, "sliding_window": 262144,
                  "rope_scaling": {"type": "su", "short_factor": _factors(48, 1.2),
                                   "long_factor": _factors(48, 40.0)}}
PHI4_MINI = {**_BASE, "vocab_size": 200064, "hidden_size": 3072, "num_attention_heads": 24,
             "num_key_value_heads": 8, "max_position_embeddings": 131072,
             "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
             "tie_word_embeddings": True, "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", "short_factor": _factors(48, 1.5),
                              "long_factor": _factors(48, 60.0)}}


def test_phi3_mini_4k():
  cfg = ModelConfig.from_hf_config(PHI3_MINI_4K)
  assert (cfg.model_type, cfg.head_dim, cfg.rotary_dim, cfg.sliding_window) == (
      "phi3", 96, 96, 2047)
  assert cfg.rope_scaling is None and not cfg.tie_word_embeddings


@pytest.mark.parametrize("raw", [PHI3_MINI_128K, PHI4_MINI], ids=["phi3-128k", "phi4-mini"])
def test_longrope_configs(raw):
  cfg = ModelConfig.from_hf_config(raw)
  rs = cfg.rope_scaling
  assert isinstance(rs, LongRopeScaling) and rs.original_max_position_embeddings == 4096
  assert cfg.rotary_dim == int(cfg.head_dim * raw.get("partial_rotary_factor", 1.0))
  assert len(rs.short_factor) == cfg.rotary_dim // 2
  assert cfg.tie_word_embeddings == raw.get("tie_word_embeddings", False)
  assert not rs.use_long  # until an engine resolves it
  assert cfg.for_max_model_len(4096).rope_scaling.use_long is False
  assert cfg.for_max_model_len(4097).rope_scaling.use_long is True


@pytest.mark.parametrize("raw", [PHI3_MINI_4K, PHI3_MINI_128K, PHI4_MINI],
                         ids=["phi3-4k", "phi3-128k", "phi4-mini"])
@pytest.mark.parametrize("seq_len", [4096, 4097])
def test_rotary_math_equals_transformers(raw, seq_len):
  """Our inverse frequencies and cos/sin factor for an engine of `seq_len` tokens equal
  transformers' rotary init for a sequence of that length."""
  hf = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
  kind = hf.rope_parameters["rope_type"]
  if kind == "default":
    head_dim = hf.hidden_size // hf.num_attention_heads
    dim = int(head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
    want = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    want_scale = 1.0
  else:
    want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf, None, seq_len=seq_len)
  cfg = ModelConfig.from_hf_config(raw).for_max_model_len(seq_len)
  np.testing.assert_allclose(layers.rope_inv_freq(cfg), want.numpy(), rtol=1e-6)
  assert layers.rope_attention_scale(cfg) == pytest.approx(want_scale, rel=1e-12)


def test_factor_and_attention_factor_overrides():
  rope = {**PHI4_MINI["rope_scaling"], "factor": 8.0}
  rs = ModelConfig.from_hf_config({**PHI4_MINI, "rope_scaling": rope}).rope_scaling
  assert rs.attention_factor == pytest.approx(np.sqrt(1 + np.log(8.0) / np.log(4096)))
  rope = {**rope, "attention_factor": 1.5}
  assert ModelConfig.from_hf_config({**PHI4_MINI, "rope_scaling": rope}
                                    ).rope_scaling.attention_factor == 1.5


def test_unsupported_configs_raise():
  with pytest.raises(ValueError, match="rope type 'dynamic'.*longrope"):
    ModelConfig.from_hf_config({**PHI4_MINI, "rope_scaling": {"type": "dynamic", "factor": 2}})
  with pytest.raises(ValueError, match="hidden_act 'gelu'"):
    ModelConfig.from_hf_config({**PHI3_MINI_4K, "hidden_act": "gelu"})
  short = {**PHI4_MINI["rope_scaling"], "short_factor": _factors(64, 1.5)}
  with pytest.raises(ValueError, match="short_factor has 64 entries; rotary_dim=96 needs 48"):
    ModelConfig.from_hf_config({**PHI4_MINI, "rope_scaling": short})


def test_fused_splits_check_rows():
  cfg = ModelConfig.from_hf_config({**PHI4_MINI, "num_hidden_layers": 1})
  q, k, v = phi3.split_qkv(np.arange(5120)[:, None], cfg)  # 24*128 + 2 * 8*128 rows
  assert (q[0, 0], k[0, 0], v[0, 0], len(q), len(k), len(v)) == (0, 3072, 4096, 3072, 1024, 1024)
  gate, up = phi3.split_gate_up(np.arange(16384)[:, None], cfg)
  assert (gate[-1, 0], up[0, 0]) == (8191, 8192)
  with pytest.raises(ValueError, match="fused qkv has 5000 rows; this config needs 5120"):
    phi3.split_qkv(np.zeros((5000, 1)), cfg)
  with pytest.raises(ValueError, match="fused gate_up has 8192 rows"):
    phi3.split_gate_up(np.zeros((8192, 1)), cfg)


def test_orbax_config_round_trip():
  cfg = ModelConfig.from_hf_config(PHI4_MINI).for_max_model_len(8192)
  assert config_from_dict(config_to_dict(cfg)) == cfg
  # A llama3 scaling saved before rope types were tagged still reads back as llama3's.
  llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
  old = {**config_to_dict(ModelConfig.from_hf_config(PHI3_MINI_4K)), "model_type": "llama",
         "rope_scaling": llama3}
  assert config_from_dict(old).rope_scaling == RopeScaling(**llama3)
