"""GPT-OSS pieces against transformers: config, YaRN, routing, clamped SwiGLU, the forward.

The forward runs the whole layer stack with a dense attention callback
(tests/attention_ref.py: sinks, per-layer windows) on a prompt longer than
the tiny model's window, and must give transformers' float32 logits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from attention_ref import dense_logits

from checkpoints import load_checkpoint
from checkpoints.hf import load_hf_config
from serving.models import gpt_oss, layers
from tiny_models import save_tiny_model

LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gpt_oss"))
  return path, save_tiny_model("gpt_oss", path)


def test_config(tiny):
  _, cfg = load_hf_config(tiny[0])
  assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
  assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None] and cfg.is_hybrid
  assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.qkv_bias
  assert (cfg.moe_activation, cfg.swiglu_alpha, cfg.swiglu_limit) == ("clamped_swiglu", 1.702, 0.3)
  assert cfg.moe_intermediate_size == 64 and cfg.num_experts == 4


@pytest.mark.parametrize("field,value,message", [
    ("layer_types", ["sliding_attention", "chunked_attention"] * 2, "chunked_attention"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
])
def test_unsupported_config_raises(tiny, tmp_path, field, value, message):
  with open(os.path.join(tiny[0], "config.json")) as f:
    raw = json.load(f)
  raw.pop("rope_parameters")
  raw[field] = value
  with pytest.raises(ValueError, match=f"{message}.*supported"):
    gpt_oss.config_from_hf(raw)


@pytest.mark.parametrize("rope", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),  # gpt-oss-20b / 120b
    dict(factor=4.0, original_max_position_embeddings=256),  # defaults; truncate True
    dict(factor=8.0, mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0,
         original_max_position_embeddings=512),
    dict(attention_factor=0.9, factor=None, original_max_position_embeddings=1024),
])
def test_yarn_matches_transformers(rope):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  head_dim, theta, max_pos = 64, 150000.0, 8192
  hf_cfg = transformers.GptOssConfig(
      head_dim=head_dim, max_position_embeddings=max_pos, num_hidden_layers=2,
      rope_parameters={"rope_type": "yarn", "rope_theta": theta, **rope})
  want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
  yarn = gpt_oss.parse_rope({"rope_type": "yarn", **rope}, max_pos)
  np.testing.assert_allclose(layers.yarn_inv_freq(head_dim, theta, yarn), want_freq.numpy(),
                             rtol=1e-6)
  assert yarn.attention_factor == pytest.approx(want_factor, rel=1e-12)


def test_clamped_swiglu_matches_transformers(tiny):
  torch.manual_seed(1)
  experts = tiny[1].model.layers[0].mlp.experts  # limit 0.3: both sides of each clamp
  gate_up = 2 * torch.randn(64, 128)  # [T, 2M] interleaved gate / up
  want = experts._apply_gate(gate_up).numpy()
  got = layers.clamped_swiglu(jnp.asarray(gate_up[:, 0::2].numpy()),
                               jnp.asarray(gate_up[:, 1::2].numpy()), 1.702, 0.3)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


def test_routing_matches_transformers(tiny):
  router = tiny[1].model.layers[0].mlp.router
  x = torch.randn(16, 64)
  _, scores, ids = router(x)
  logits = x.numpy() @ router.weight.detach().numpy().T + router.bias.detach().numpy()
  weights, got_ids = gpt_oss.route_topk_softmax(jnp.asarray(logits), 2)
  np.testing.assert_array_equal(np.asarray(got_ids), ids.numpy())
  np.testing.assert_allclose(np.asarray(weights), scores.detach().numpy(), rtol=1e-6)


def test_forward_matches_transformers(tiny):
  loaded = load_checkpoint(tiny[0])
  ids = [int(i) for i in np.random.RandomState(0).randint(0, 256, 40)]  # 5x the window
  with torch.no_grad():
    want = tiny[1](torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(dense_logits(loaded.params, loaded.config, ids), want,
                             atol=LOGIT_ATOL)
  # Each GPT-OSS piece moves the logits by far more than the tolerance.
  cfg = loaded.config
  for variant in (dataclasses.replace(cfg, layer_types=()),  # window on every layer
                  dataclasses.replace(cfg, rope_scaling=None),
                  dataclasses.replace(cfg, swiglu_limit=7.0)):
    assert np.abs(dense_logits(loaded.params, variant, ids) - want).max() > 5 * LOGIT_ATOL
