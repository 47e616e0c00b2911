"""GPT-OSS (`GptOssForCausalLM`) as flax nnx modules.

What a GPT-OSS layer adds to a Llama-shaped MoE layer (transformers'
modeling_gpt_oss):

- layers alternate sliding-window (128 tokens) and full attention
  (`layer_types`), and every head has a learned sink logit that joins the
  softmax and is then dropped ("sinks" [N], passed to the attention
  callback as `sinks=`);
- the q/k/v/o projections carry biases ("bq", "bk", "bv", "bo");
- the router has a bias ("router_bias" [E]) and weights the top k logits by a
  softmax over those k alone;
- the experts carry biases ("be_gate", "be_up" [E, M], "be_down" [E, D]) and
  a clamped SwiGLU (`ModelConfig.moe_activation == "clamped_swiglu"`, run by
  the experts callback, expert-parallel too); the down bias is added here,
  weighted like its expert's output, after the experts' partial sums;
- YaRN RoPE, whose attention factor scales cos and sin (so q and k);
- real checkpoints store the experts in MXFP4, kept as stored
  (checkpoints/hf_mxfp4.py: `QuantizedWeight(kind="mxfp4")`).

Dimension letters: T tokens, D model dim, N query heads, K kv heads, H head
dim, E experts, M expert mlp dim.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, param, value
from serving.models.model_config import ModelConfig, YarnScaling, hf_eos_token_ids

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("yarn", "default")


class GptOssLayer(DecoderLayer):
  """Pre-norm attention with biases and sinks, then a mixture of clamped-SwiGLU experts
  with biases."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    d, h, e, m = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    self.attn_norm, self.mlp_norm = param(d), param(d)
    self.wq, self.wk, self.wv, self.wo = param(d, nh), param(d, kh), param(d, kh), param(nh, d)
    self.bq, self.bk, self.bv, self.bo = param(nh), param(kh), param(kh), param(d)
    self.sinks = param(cfg.num_heads)
    self.router, self.router_bias = param(d, e), param(e)
    self.we_gate, self.we_up, self.we_down = param(e, d, m), param(e, d, m), param(e, m, d)
    self.be_gate, self.be_up, self.be_down = param(e, m), param(e, m), param(e, d)

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    xn = L.rms_norm(h, value(self.attn_norm), cfg.rms_norm_eps)
    biases = (value(self.bq), value(self.bk), value(self.bv))
    q, k, v = L.qkv_heads(cfg, xn, value(self.wq), value(self.wk), value(self.wv), lora, biases)
    inv_freq, scale = rope  # YaRN scales cos and sin
    q, k = L.apply_rope(q, positions, inv_freq, scale), L.apply_rope(k, positions, inv_freq, scale)
    out, kv = attend(layer, q, k, v, kv, sinks=value(self.sinks).astype(jnp.float32))
    o = L.attention_output(out, value(self.wo), h.dtype, lora)
    h = h + o + value(self.bo).astype(h.dtype)
    hn = L.rms_norm(h, value(self.mlp_norm), cfg.rms_norm_eps)
    return h + self.experts(hn, experts_fn), kv

  def experts(self, x: jax.Array, experts_fn: L.ExpertsFn | None) -> jax.Array:
    """The MoE block over normed x [T, D] -> [T, D]."""
    cfg = self.cfg
    logits = L.linear(x, value(self.router)) + value(self.router_bias).astype(x.dtype)
    weights, ids = route_topk_softmax(logits, cfg.num_experts_per_tok)
    experts = tuple(value(w) for w in (self.we_gate, self.we_up, self.we_down, self.be_gate,
                                       self.be_up))
    if experts_fn is not None:
      out = experts_fn(x, weights, ids, experts)
    else:
      out = L.moe_experts(x, weights, ids, *experts, activation=L.expert_activation(cfg))
    down_bias = value(self.be_down).astype(jnp.float32)[ids]  # [T, k, D]
    return (out + jnp.einsum("tk,tkd->td", weights, down_bias)).astype(x.dtype)


class Model(CausalLM):
  """A GPT-OSS model (embedding, GptOssLayer stack, final RMSNorm, untied head)."""

  layer_class = GptOssLayer

  def rope(self) -> Any:
    """(inverse frequencies [H/2], the factor scaling cos and sin)."""
    return jnp.asarray(L.rope_inv_freq(self.cfg)), L.rope_attention_scale(self.cfg)


def route_topk_softmax(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """router_logits [T, E] -> (weights [T, k] f32, ids [T, k]): the top k logits, then a
  softmax over those k."""
  top, ids = jax.lax.top_k(router_logits.astype(jnp.float32), k)
  return jax.nn.softmax(top, axis=-1), ids


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
  """A GPT-OSS HF `config.json` dict -> ModelConfig. Unknown layer / rope types raise."""
  num_layers = raw["num_hidden_layers"]
  layer_types = tuple(raw.get("layer_types") or (
      "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)))
  for kind in layer_types:
    if kind not in LAYER_TYPES:
      raise ValueError(f"unsupported layer type {kind!r} in a GptOssForCausalLM config "
                       f"(supported: {LAYER_TYPES})")
  if not raw.get("attention_bias", True):
    raise ValueError("GptOssForCausalLM without attention biases is not supported")
  rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
  theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 150000.0)
  hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
  max_pos = raw.get("max_position_embeddings", 131072)
  return ModelConfig(
      model_type="gpt_oss", family="gpt_oss", vocab_size=raw["vocab_size"],
      hidden_size=hidden, intermediate_size=raw["intermediate_size"], num_layers=num_layers,
      num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
      head_dim=raw.get("head_dim") or hidden // heads,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), rope_theta=theta,
      rope_scaling=parse_rope(rope, max_pos), max_position_embeddings=max_pos,
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), qkv_bias=True,
      sliding_window=raw.get("sliding_window"), layer_types=layer_types,
      attention_sinks=True,
      num_experts=raw.get("num_local_experts") or raw["num_experts"],
      num_experts_per_tok=raw.get("num_experts_per_tok") or raw["experts_per_token"],
      moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=False,
      moe_activation="clamped_swiglu", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
      swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=hf_eos_token_ids(raw))


def parse_rope(rope: dict[str, Any], max_position_embeddings: int) -> YarnScaling | None:
  """`rope_scaling` / `rope_parameters` -> YarnScaling (None for plain RoPE), resolved as
  transformers' `_compute_yarn_parameters`: factor from the context lengths when absent,
  the attention factor from `mscale` / `mscale_all_dim` or `0.1 ln(factor) + 1`, beta
  defaults 32 / 1, `truncate` default True."""
  kind = rope.get("rope_type") or rope.get("type") or "default"
  if kind not in ROPE_TYPES:
    raise ValueError(f"unsupported rope type {kind!r} for GptOssForCausalLM (supported: "
                     f"{ROPE_TYPES})")
  if kind == "default":
    return None
  original = int(rope["original_max_position_embeddings"])
  factor = rope.get("factor")
  factor = float(factor) if factor is not None else max_position_embeddings / original
  attention_factor = rope.get("attention_factor")
  if attention_factor is None:
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
      attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
      attention_factor = _yarn_mscale(factor)
  return YarnScaling(factor=factor, beta_fast=float(rope.get("beta_fast") or 32),
                     beta_slow=float(rope.get("beta_slow") or 1),
                     original_max_position_embeddings=original,
                     truncate=bool(rope.get("truncate", True)),
                     attention_factor=float(attention_factor))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
