"""Gemma 2 / Gemma 3 under tensor and pipeline parallelism (4 simulated CPU devices).

One worker runs each tiny model through the runner's own prefill / decode
programs at tp = 2, pp = 2 and pp = 2 x tp = 2 (Gemma 3: layers 0-2 on stage
0, the full-attention layer 5 on stage 1, so each stage must know its layers'
global ids for their windows and RoPE bases) and reports greedy tokens and
logits; they must equal one device's and `transformers`' greedy tokens.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "pp2tp2": {"pp": 2, "tp": 2}}
FAMILIES = ("gemma2", "gemma3")
NUM_TOKENS = 16  # 10-token prompt + 16 > 2 windows of 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from tiny_models import save_tiny_model

  out = {}
  for family in FAMILIES:
    path = str(tmp_path_factory.mktemp(family))
    out[family] = (path, save_tiny_model(family, path))
  return out


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *(models[f][0] for f in FAMILIES), devices=4, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_match_one_device_and_transformers(result, models, family):
  from tiny_models import torch_greedy

  want = [torch_greedy(models[family][1], p, NUM_TOKENS)[0] for p in stu.PROMPTS]
  base = result[family]["1"]
  assert base["tokens"] == want
  for name in list(LAYOUTS)[1:]:
    got = result[family][name]
    assert got["tokens"] == want, (family, name)
    np.testing.assert_allclose(got["prefill_logits"], base["prefill_logits"],
                               atol=stu.LOGIT_ATOL)
    np.testing.assert_allclose(got["decode_logits"], base["decode_logits"], atol=stu.LOGIT_ATOL)


def test_zero_padded_layers_are_identities(models):
  """pp that does not divide L pads zero layers (full attention): Gemma's post-norms of a
  zero output are zero, so the padded model computes the same hidden states."""
  import jax.numpy as jnp

  import checkpoints
  from serving.models import causal_lm
  from sharding import pipeline

  loaded = checkpoints.load_checkpoint(models["gemma3"][0])
  padded, cfg = pipeline.pad_layers(loaded.params, loaded.config, 4)
  assert cfg.num_layers == 8 and cfg.layer_types[6:] == ("full_attention",) * 2
  tokens = jnp.asarray(stu.PROMPTS[0] * 2, jnp.int32)
  positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  want, _ = causal_lm.forward(causal_lm.unstack_layers(loaded.params), loaded.config, tokens,
                              positions, None, _dense_attend(loaded.config, positions))
  got, _ = causal_lm.forward(causal_lm.unstack_layers(padded), cfg, tokens, positions, None,
                             _dense_attend(cfg, positions))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def _dense_attend(cfg, positions):
  """Causal attention over one sequence with each layer's window, scale and soft cap."""
  import jax
  import jax.numpy as jnp

  from serving.models import layers

  def attend(layer, q, k, v, kv):
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = layers.soft_cap(jnp.einsum("qnh,knh->nqk", q, k) * cfg.scale, cfg.attn_soft_cap)
    dist = positions[:, None] - positions[None, :]
    window = cfg.layer_window(layer)
    mask = (dist >= 0) & (dist < (window or dist.shape[0] + 1))
    p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("nqk,knh->qnh", p, v), kv

  return attend


def _worker(*paths: str) -> None:
  import checkpoints

  out = {}
  for family, path in zip(FAMILIES, paths, strict=True):
    loaded = checkpoints.load_checkpoint(path)
    out[family] = {}
    for name, layout in LAYOUTS.items():
      drv = stu.Driver(stu.make_runner(loaded, **layout))
      tokens, first, dec = drv.generate(stu.PROMPTS, NUM_TOKENS)
      out[family][name] = dict(tokens=tokens, prefill_logits=first.tolist(),
                               decode_logits=dec.tolist())
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
