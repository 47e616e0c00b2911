"""The Gemma family as flax nnx modules: Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3
text (`Gemma3ForCausalLM`).

What sets Gemma apart from the Llama layer (transformers' modeling_gemma2/3):
  * RMSNorm scales by `(1 + w)`, computed in float32; the weights are stored
    zero-centred as in the HF checkpoint (GGUF files hold `1 + w`, see
    checkpoints/gguf.py);
  * four norms per layer: the attention output and the MLP output are normed
    before their residual add (`post_attn_norm`, `post_mlp_norm`) besides the
    usual pre-norms (`attn_norm`, `mlp_norm` = pre_feedforward_layernorm);
  * GeGLU MLP: `down(gelu_tanh(gate(x)) * up(x))`;
  * embeddings scaled by sqrt(hidden) in the activation dtype; tied LM head;
  * attention scale `query_pre_attn_scalar ** -0.5`;
  * layers of two kinds (`layer_types`): sliding-window and full attention,
    alternating in Gemma 2, five to one in Gemma 3;
  * Gemma 2: tanh soft-capping of attention scores and of the final logits;
  * Gemma 3: q/k RMSNorm, a separate RoPE base for the sliding layers
    (`rope_local_base_freq`, unscaled) and the global base with linear scaling
    on the larger models; final soft-capping only where configured.

The runner's attention callback applies the window, scale and score cap per
layer from the config (serving/runner/steps.py); the layer picks its RoPE
table by its global id. The module convention: serving/models/causal_lm.py.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, param, value
from serving.models.model_config import (
  LAYER_TYPES,
  LinearRopeScaling,
  ModelConfig,
  hf_eos_token_ids,
)

FAMILY = "gemma"
HF_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
MODEL_TYPES = ("gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear")
ACTIVATION = "gelu_pytorch_tanh"

# transformers' config defaults where a config.json leaves a key out.
_DEFAULTS = {
    "gemma2": dict(max_position_embeddings=8192, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, rope_theta=10000.0, pattern=2),
    "gemma3_text": dict(max_position_embeddings=131072, final_logit_softcapping=None,
                        rope_theta=1_000_000.0, rope_local_base_freq=10000.0, pattern=6),
}

# HF per-layer tensor names (after "model.layers.{i}.") that differ from the Llama table
# (checkpoints/hf.py).
HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}


class GemmaLayer(DecoderLayer):
  """Pre- and post-normed self-attention, then a pre- and post-normed GeGLU MLP."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    d, h, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    self.attn_norm, self.post_attn_norm = param(d), param(d)
    self.mlp_norm, self.post_mlp_norm = param(d), param(d)
    self.wq, self.wk, self.wv, self.wo = param(d, nh), param(d, kh), param(d, kh), param(nh, d)
    self.q_norm, self.k_norm = (param(h), param(h)) if cfg.qk_norm else (None, None)
    self.w_gate, self.w_up, self.w_down = param(d, f), param(d, f), param(f, d)

  def _norm(self, x: jax.Array, w: Any) -> jax.Array:
    return L.rms_norm_plus_one(x, value(w), self.cfg.rms_norm_eps)

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    xn = self._norm(h, self.attn_norm)
    q, k, v = L.qkv_heads(cfg, xn, value(self.wq), value(self.wk), value(self.wv), lora)
    if cfg.qk_norm:
      q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
    inv_freq = layer_rope(cfg, rope, layer)
    q, k = L.apply_rope(q, positions, inv_freq), L.apply_rope(k, positions, inv_freq)
    out, kv = attend(layer, q, k, v, kv)
    h = h + self._norm(L.attention_output(out, value(self.wo), h.dtype, lora),
                       self.post_attn_norm)
    hn = self._norm(h, self.mlp_norm)
    mlp = L.gated_mlp(hn, value(self.w_gate), value(self.w_up), value(self.w_down), lora,
                      act=ACTIVATION)
    return h + self._norm(mlp, self.post_mlp_norm), kv


def layer_rope(cfg: ModelConfig, rope: tuple[jax.Array, jax.Array], layer) -> jax.Array:
  """The inverse frequencies of global layer `layer` from `Model.rope()`'s (full, local):
  chosen statically for a Python int, looked up by kind for a traced id."""
  full, local = rope
  if isinstance(layer, int):
    return local if cfg.layer_window(layer) is not None else full
  sliding = jnp.asarray(np.asarray([w is not None for w in cfg.layer_windows]))
  return jnp.where(sliding[layer], local, full)


class Model(CausalLM):
  """A Gemma 2 / 3 model: scaled embedding, GemmaLayer stack, (1 + w) final norm,
  soft-capped logits."""

  layer_class = GemmaLayer

  def embed_tokens(self, tokens: jax.Array, act_dtype) -> jax.Array:
    """Embedding rows times sqrt(hidden), rounded to the activation dtype as
    transformers' scaled embedding does."""
    x = L.embed_tokens(value(self.embed), tokens).astype(act_dtype)
    return x * jnp.asarray(math.sqrt(self.cfg.hidden_size), jnp.float32).astype(act_dtype)

  def norm(self, x: jax.Array) -> jax.Array:
    """The final (1 + w) RMSNorm."""
    return L.rms_norm_plus_one(x, value(self.final_norm), self.cfg.rms_norm_eps)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, D] -> logits [B, V] in float32, soft-capped where configured."""
    return L.soft_cap(super().logits(hidden), self.cfg.final_soft_cap)

  def rope(self) -> tuple[jax.Array, jax.Array]:
    """(full layers', sliding layers') inverse frequencies [H/2]: the sliding layers
    use `local_rope_theta` unscaled where set (Gemma 3), else the full layers' table."""
    cfg = self.cfg
    full = jnp.asarray(L.rope_inv_freq(cfg))
    if cfg.local_rope_theta is None:
      return full, full
    return full, jnp.asarray(L.rope_inv_freq(cfg, cfg.local_rope_theta, scaled=False))


# -- config parsing ------------------------------------------------------------------------------


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
  """A Gemma 2 / Gemma 3 (text) `config.json` dict -> ModelConfig; unsupported settings
  raise ValueError naming the supported ones."""
  model_type = _model_type(raw)
  d = _DEFAULTS[model_type]
  _check_supported(raw)
  num_layers = raw["num_hidden_layers"]
  num_heads = raw.get("num_attention_heads", 8)
  theta, scaling, local_theta = _rope(raw, model_type)
  gemma3 = model_type == "gemma3_text"
  return ModelConfig(
      model_type=model_type,
      family=FAMILY,
      vocab_size=raw["vocab_size"],
      hidden_size=raw["hidden_size"],
      intermediate_size=raw["intermediate_size"],
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=raw.get("num_key_value_heads") or num_heads,
      head_dim=raw.get("head_dim") or 256,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
      rope_theta=theta,
      rope_scaling=scaling,
      local_rope_theta=local_theta,
      max_position_embeddings=raw.get("max_position_embeddings", d["max_position_embeddings"]),
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
      qk_norm=gemma3,
      sliding_window=raw.get("sliding_window", 4096),
      layer_types=_layer_types(raw, num_layers, d["pattern"]),
      attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
      # Gemma 3's attention ignores attn_logit_softcapping (transformers passes no softcap).
      attn_soft_cap=None if gemma3 else _opt_float(
          raw.get("attn_logit_softcapping", d["attn_logit_softcapping"])),
      final_soft_cap=_opt_float(raw.get("final_logit_softcapping",
                                        d["final_logit_softcapping"])),
      bos_token_id=raw.get("bos_token_id", 2),
      eos_token_ids=hf_eos_token_ids({"eos_token_id": raw.get("eos_token_id", 1)}),
  )


def _model_type(raw: dict[str, Any]) -> str:
  if raw.get("model_type") in MODEL_TYPES:
    return raw["model_type"]
  for arch in raw.get("architectures") or []:
    if arch in HF_ARCHITECTURES:
      return HF_ARCHITECTURES[arch]
  raise ValueError(f"not a Gemma 2/3 text config: model_type={raw.get('model_type')!r}, "
                   f"architectures={raw.get('architectures')} (supported: {list(MODEL_TYPES)})")


def _check_supported(raw: dict[str, Any]) -> None:
  act = raw.get("hidden_activation") or raw.get("hidden_act") or ACTIVATION
  if act != ACTIVATION:
    raise ValueError(f"unsupported Gemma hidden_activation {act!r} (supported: "
                     f"[{ACTIVATION!r}])")
  if raw.get("use_bidirectional_attention"):
    raise ValueError("unsupported Gemma config: use_bidirectional_attention=True (an encoder; "
                     "supported: causal attention)")
  if raw.get("attention_bias"):
    raise ValueError("unsupported Gemma config: attention_bias=True (supported: no biases)")


def _layer_types(raw: dict[str, Any], num_layers: int, pattern: int) -> tuple[str, ...]:
  """`layer_types`, or transformers' default: every `pattern`-th layer full, the rest sliding."""
  types = raw.get("layer_types")
  if types is None:
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or pattern
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(num_layers)]
  bad = sorted({t for t in types if t not in LAYER_TYPES})
  if bad:
    raise ValueError(f"unsupported layer type(s) {bad} (supported: {list(LAYER_TYPES)})")
  if len(types) != num_layers:
    raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
  return tuple(types)


def _rope(raw: dict[str, Any], model_type: str
          ) -> tuple[float, LinearRopeScaling | None, float | None]:
  """(full layers' base, their scaling, sliding layers' base or None) from either the
  transformers 5 `rope_parameters` or the legacy rope_theta / rope_scaling /
  rope_local_base_freq keys."""
  d = _DEFAULTS[model_type]
  params = raw.get("rope_parameters") or {}
  per_type = isinstance(params.get("full_attention"), dict)
  full = dict(params["full_attention"] if per_type else params)
  if not full:
    full = dict(raw.get("rope_scaling") or {})
  theta = full.get("rope_theta", raw.get("rope_theta", d["rope_theta"]))
  scaling = _scaling(full)
  if model_type != "gemma3_text":
    return float(theta), scaling, None
  local = dict(params.get("sliding_attention") or {}) if per_type else {}
  if _scaling(local) is not None:
    raise ValueError("unsupported Gemma 3 rope: scaled sliding-layer RoPE "
                     f"{local.get('rope_type')!r} (supported: 'default' there)")
  local_theta = local.get("rope_theta", raw.get("rope_local_base_freq", d["rope_local_base_freq"]))
  return float(theta), scaling, float(local_theta)


def _scaling(params: dict[str, Any]) -> LinearRopeScaling | None:
  kind = params.get("rope_type") or params.get("type") or "default"
  if kind not in ROPE_TYPES:
    raise ValueError(f"unsupported rope type {kind!r} for Gemma (supported: {list(ROPE_TYPES)})")
  return LinearRopeScaling(float(params["factor"])) if kind == "linear" else None


def _opt_float(x: Any) -> float | None:
  return None if x is None else float(x)
