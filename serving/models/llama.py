"""The Llama family as flax nnx modules: Llama 2/3/3.1 (llama3 RoPE scaling),
Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (q/k RMSNorm), SmolLM2 (tied
embeddings) and the MoE variants Mixtral / Qwen3-MoE.

`ModelConfig` flags select the pieces (`config_from_hf`); the layer is
pre-norm attention then a SwiGLU MLP or mixture of SwiGLU experts. The
params layout is documented in docs/structure.md; the module convention in
serving/models/causal_lm.py.
"""

from __future__ import annotations

from typing import Any

import jax

from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, bind_layer, param, value
from serving.models.model_config import (
  ModelConfig,
  hf_eos_token_ids,
  hf_layer_types,
  hf_rope_theta,
  parse_rope_scaling,
)

# model_type -> (qkv_bias, qk_norm, moe)
MODEL_TYPES = {
    "llama": (False, False, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, True, False),
    "mixtral": (False, False, True),
    "qwen3_moe": (False, True, True),
}
ARCHITECTURE_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class LlamaLayer(DecoderLayer):
  """Pre-norm self-attention, then a dense SwiGLU MLP or a mixture of SwiGLU experts."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    d, h = cfg.hidden_size, cfg.head_dim
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    self.attn_norm, self.mlp_norm = param(d), param(d)
    self.wq, self.wk, self.wv, self.wo = param(d, nh), param(d, kh), param(d, kh), param(nh, d)
    bias, norm = cfg.qkv_bias, cfg.qk_norm
    self.bq, self.bk, self.bv = (param(nh), param(kh), param(kh)) if bias else (None,) * 3
    self.q_norm, self.k_norm = (param(h), param(h)) if norm else (None, None)
    e, m, f = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    moe = cfg.is_moe
    self.router = param(d, e) if moe else None
    self.we_gate, self.we_up, self.we_down = (
        (param(e, d, m), param(e, d, m), param(e, m, d)) if moe else (None,) * 3)
    self.w_gate, self.w_up, self.w_down = (
        (None,) * 3 if moe else (param(d, f), param(d, f), param(f, d)))

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    xn = L.rms_norm(h, value(self.attn_norm), cfg.rms_norm_eps)
    biases = (value(self.bq), value(self.bk), value(self.bv)) if cfg.qkv_bias else None
    q, k, v = L.qkv_heads(cfg, xn, value(self.wq), value(self.wk), value(self.wv), lora, biases)
    if cfg.qk_norm:
      q = L.rms_norm(q, value(self.q_norm), cfg.rms_norm_eps)
      k = L.rms_norm(k, value(self.k_norm), cfg.rms_norm_eps)
    q, k = L.apply_rope(q, positions, rope), L.apply_rope(k, positions, rope)
    out, kv = attend(layer, q, k, v, kv)
    h = h + L.attention_output(out, value(self.wo), h.dtype, lora)
    hn = L.rms_norm(h, value(self.mlp_norm), cfg.rms_norm_eps)
    if cfg.is_moe:
      experts = (value(self.we_gate), value(self.we_up), value(self.we_down))
      mlp = L.moe_mlp(cfg, value(self.router), experts, hn, experts_fn)
    else:
      mlp = L.gated_mlp(hn, value(self.w_gate), value(self.w_up), value(self.w_down), lora)
    return h + mlp, kv


class Model(CausalLM):
  """A Llama-family model (embedding, LlamaLayer stack, final RMSNorm, head)."""

  layer_class = LlamaLayer


def decoder_layer(cfg: ModelConfig, lp: dict[str, Any], h: jax.Array, positions: jax.Array,
                  inv_freq: jax.Array, layer: Any, kv: Any, attend: L.AttendFn,
                  experts_fn: L.ExpertsFn | None = None, lora: L.LayerLora = None):
  """One layer over the weights dict `lp`: h [T, D] -> (h, kv) (tools that run a
  layer at a time, e.g. serving/tools/gptq.py)."""
  return bind_layer(lp, cfg)(h, positions, inv_freq, layer, kv, attend, experts_fn=experts_fn,
                             lora=lora)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a Llama-family HF config dict."""
  model_type = cfg.get("model_type")
  if model_type not in MODEL_TYPES:
    archs = cfg.get("architectures") or []
    model_type = next(ARCHITECTURE_TO_TYPE[a] for a in archs if a in ARCHITECTURE_TO_TYPE)
  qkv_bias, qk_norm, moe = MODEL_TYPES[model_type]
  num_heads = cfg["num_attention_heads"]
  hidden = cfg["hidden_size"]
  sliding = cfg.get("sliding_window")
  if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
    sliding = None
  return ModelConfig(
      model_type=model_type,
      family="llama",
      vocab_size=cfg["vocab_size"],
      hidden_size=hidden,
      intermediate_size=cfg.get("intermediate_size", 0),
      num_layers=cfg["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
      head_dim=cfg.get("head_dim") or hidden // num_heads,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      rope_theta=hf_rope_theta(cfg),
      rope_scaling=parse_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
      max_position_embeddings=cfg.get("max_position_embeddings", 4096),
      tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=bool(cfg.get("attention_bias", qkv_bias)),
      qk_norm=qk_norm,
      sliding_window=sliding,
      layer_types=hf_layer_types(cfg, sliding),
      num_experts=(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if moe else 0,
      num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
      moe_intermediate_size=(cfg.get("moe_intermediate_size")
                             or cfg.get("intermediate_size", 0)) if moe else 0,
      norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "mixtral")),
      bos_token_id=cfg.get("bos_token_id"),
      eos_token_ids=hf_eos_token_ids(cfg),
  )
