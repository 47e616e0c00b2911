"""Gemma 2 / Gemma 3 GGUF files laid out as llama.cpp's converter writes them.

`gemma_gguf_from_model` follows convert_hf_to_gguf.py's Gemma2Model / Gemma3Model:
tensor names from gguf-py's own name map, `1 + w` stored for every norm, the
metadata keys those classes write (and nothing llama.cpp hard-codes: the
5:1 / alternating layer pattern, the local RoPE base 10000, the attention
scale). Loading the file must give exactly the params and config of the HF
checkpoint it came from.
"""

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers
from ckpt_testutil import TINY, add_tokenizer

from checkpoints import load_checkpoint

ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
# query_pre_attn_scalar = head_dim: what llama.cpp assumes below the 27B layer counts.
_GEMMA = dict(TINY, head_dim=32, query_pre_attn_scalar=32, sliding_window=8)
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(**{**_GEMMA, "num_hidden_layers": 4},
                                                attn_logit_softcapping=20.0,
                                                final_logit_softcapping=15.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**_GEMMA, "num_hidden_layers": 6}, final_logit_softcapping=25.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
}


def tiny_gemma(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
  """A random Gemma causal LM (float32) with norms away from zero."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.5)
  return model.eval()


def gemma_gguf_from_model(model, path: str, arch: str) -> None:
  """Writes `model` as an F32 GGUF the way llama.cpp's converter does for Gemma 2/3."""
  cfg = model.config
  w = gguf.GGUFWriter(path, arch)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_sliding_window(cfg.sliding_window)
  if cfg.final_logit_softcapping:
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
  if arch == "gemma2":
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
  else:
    full = cfg.rope_parameters["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
      w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      w.add_rope_scaling_factor(full["factor"])
  add_tokenizer(w)
  names = gguf.get_tensor_name_map(ARCH[arch], cfg.num_hidden_layers)
  for name, value in model.state_dict().items():
    if name == "lm_head.weight":  # tied: llama.cpp skips it
      continue
    value = value.detach().float().numpy()
    if name.endswith("norm.weight"):
      value = value + np.float32(1.0)
    w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(value))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_loads_as_the_hf_checkpoint(tmp_path, arch):
  model = tiny_gemma(arch)
  model.save_pretrained(str(tmp_path / "hf"))
  gemma_gguf_from_model(model, str(tmp_path / "m.gguf"), arch)
  hf = load_checkpoint(str(tmp_path / "hf"))
  gg = load_checkpoint(str(tmp_path / "m.gguf"))
  assert gg.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # float32 in GGUF
  ids = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=hf.config.rms_norm_eps)
  assert dataclasses.replace(gg.config, **ids) == dataclasses.replace(hf.config, **ids)
  assert set(gg.params) == set(hf.params) and set(gg.params["layers"]) == set(
      hf.params["layers"])
  for key in ("embed", "final_norm"):
    np.testing.assert_allclose(gg.params[key], hf.params[key], rtol=0, atol=1e-6, err_msg=key)
  for key, want in hf.params["layers"].items():
    np.testing.assert_allclose(gg.params["layers"][key], want, rtol=0, atol=1e-6, err_msg=key)


def test_gemma3_gguf_config(tmp_path):
  """What llama.cpp hard-codes arrives in the config: 5 sliding layers to 1 full, the local
  RoPE base, global linear scaling, the head_dim attention scale."""
  gemma_gguf_from_model(tiny_gemma("gemma3"), str(tmp_path / "m.gguf"), "gemma3")
  cfg = load_checkpoint(str(tmp_path / "m.gguf")).config
  assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
  assert (cfg.sliding_window, cfg.local_rope_theta, cfg.rope_theta) == (8, 10000.0, 1e6)
  assert cfg.rope_scaling.factor == 8.0 and cfg.qk_norm and cfg.tie_word_embeddings
  assert cfg.attn_scale == 32 ** -0.5 and cfg.final_soft_cap == 25.0
  assert cfg.attn_soft_cap is None
