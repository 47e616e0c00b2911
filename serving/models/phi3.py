"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`, model_type "phi3").

A Llama-shaped decoder (pre-norm RMSNorm, SwiGLU, GQA) with three differences,
all settled at load time so the layer code, LoRA, tensor parallelism and
quantization see the Llama params layout:

- fused projections: `qkv_proj` [(N+2K)*H, D] holds the q, k and v rows and
  `gate_up_proj` [2F, D] the gate rows then the up rows; `split_qkv` and
  `split_gate_up` cut them into `wq` / `wk` / `wv` and `w_gate` / `w_up`
  (checkpoints/hf.py and checkpoints/gguf.py call them);
- `partial_rotary_factor` (Phi-4-mini: 0.75): RoPE turns the first
  `rotary_dim` dims of each head only;
- LongRoPE (`rope_scaling` type "longrope", "su" in older configs): per
  frequency divisors, a short and a long set, and cos / sin scaled by an
  attention factor (`ModelConfig.LongRopeScaling` says which set serves).

`sliding_window`, when the config sets one, applies to every layer. The
layer is pre-norm attention then a SwiGLU MLP, as nnx modules over the
shared layers (serving/models/causal_lm.py has the convention).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, param, value
from serving.models.model_config import (
  LongRopeScaling,
  ModelConfig,
  hf_eos_token_ids,
  hf_rope_theta,
)

MODEL_TYPE = "phi3"
ARCHITECTURE = "Phi3ForCausalLM"
# transformers reads "su" and "yarn" as LongRoPE for Phi-3 (configuration_phi3.py).
_LONGROPE_NAMES = ("longrope", "su", "yarn")


class Phi3Layer(DecoderLayer):
  """Pre-norm self-attention (RoPE on the first `rotary_dim` dims, cos / sin times the
  LongRoPE attention factor), then a SwiGLU MLP; the fused projections arrive split."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    self.attn_norm, self.mlp_norm = param(d), param(d)
    self.wq, self.wk, self.wv, self.wo = param(d, nh), param(d, kh), param(d, kh), param(nh, d)
    self.w_gate, self.w_up, self.w_down = param(d, f), param(d, f), param(f, d)

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    xn = L.rms_norm(h, value(self.attn_norm), cfg.rms_norm_eps)
    q, k, v = L.qkv_heads(cfg, xn, value(self.wq), value(self.wk), value(self.wv), lora)
    scale = L.rope_attention_scale(cfg)  # `rope`: inverse frequencies [rotary_dim / 2]
    q, k = L.apply_rope(q, positions, rope, scale), L.apply_rope(k, positions, rope, scale)
    out, kv = attend(layer, q, k, v, kv)
    h = h + L.attention_output(out, value(self.wo), h.dtype, lora)
    hn = L.rms_norm(h, value(self.mlp_norm), cfg.rms_norm_eps)
    return h + L.gated_mlp(hn, value(self.w_gate), value(self.w_up), value(self.w_down),
                           lora), kv


class Model(CausalLM):
  """A Phi-3 model (embedding, Phi3Layer stack, final RMSNorm, head or tied embedding)."""

  layer_class = Phi3Layer


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
  """A Phi-3 `config.json` dict -> ModelConfig; what we cannot serve raises ValueError."""
  act = raw.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"unsupported Phi-3 hidden_act {act!r} (supported: 'silu')")
  heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
  head_dim = raw.get("head_dim") or hidden // heads
  # transformers: rope_scaling wins over rope_parameters; keys inside it over top-level ones.
  rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
  theta = float(rope.get("rope_theta", hf_rope_theta(raw)))
  partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
  max_pos = raw.get("max_position_embeddings", 4096)
  return ModelConfig(
      model_type=MODEL_TYPE,
      family="phi3",
      vocab_size=raw["vocab_size"],
      hidden_size=hidden,
      intermediate_size=raw["intermediate_size"],
      num_layers=raw["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=raw.get("num_key_value_heads") or heads,
      head_dim=head_dim,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
      rope_theta=theta,
      rope_scaling=longrope_scaling(raw, rope, max_pos),
      partial_rotary_factor=partial,
      max_position_embeddings=max_pos,
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
      sliding_window=raw.get("sliding_window") or None,
      bos_token_id=raw.get("bos_token_id"),
      eos_token_ids=hf_eos_token_ids(raw),
  )


def longrope_scaling(raw: dict[str, Any], rope: dict[str, Any], max_pos: int
                     ) -> LongRopeScaling | None:
  """The LongRoPE parameters of a Phi-3 config (None for plain RoPE), as transformers'
  `_compute_longrope_parameters` derives them; the short set until an engine resolves
  the choice (`ModelConfig.for_max_model_len`)."""
  kind = rope.get("rope_type") or rope.get("type")
  if kind in (None, "default"):
    return None
  if kind not in _LONGROPE_NAMES:
    raise ValueError(f"unsupported Phi-3 rope type {kind!r} (supported: 'default', "
                     "'longrope', 'su')")
  # Phi3Config keeps the top-level original_max_position_embeddings (default 4096).
  orig = int(raw.get("original_max_position_embeddings", 4096))
  factor = rope.get("factor") or max_pos / orig
  attention_factor = rope.get("attention_factor")
  if attention_factor is None:
    attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
  return LongRopeScaling(
      short_factor=tuple(float(f) for f in rope["short_factor"]),
      long_factor=tuple(float(f) for f in rope["long_factor"]),
      original_max_position_embeddings=orig, attention_factor=float(attention_factor),
      use_long=False)


def fused_rows(cfg: ModelConfig) -> dict[str, slice]:
  """The rows of the fused qkv_proj / attn_qkv (wq, wk, wv) and gate_up_proj / ffn_up
  (w_gate, w_up) tensors ([out, in]) that each params key takes."""
  q, k, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
  return {"wq": slice(0, q), "wk": slice(q, q + k), "wv": slice(q + k, q + 2 * k),
          "w_gate": slice(0, f), "w_up": slice(f, 2 * f)}


def split_qkv(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A fused qkv_proj / attn_qkv [(N+2K)*H, ...] -> its q, k, v rows (views)."""
  rows = fused_rows(cfg)
  if w.shape[0] != rows["wv"].stop:
    raise ValueError(f"fused qkv has {w.shape[0]} rows; this config needs {rows['wv'].stop}")
  return w[rows["wq"]], w[rows["wk"]], w[rows["wv"]]


def split_gate_up(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """A fused gate_up_proj / ffn_up [2F, ...] -> (gate rows, up rows) (views)."""
  rows = fused_rows(cfg)
  if w.shape[0] != rows["w_up"].stop:
    raise ValueError(f"fused gate_up has {w.shape[0]} rows; this config needs "
                     f"{rows['w_up'].stop}")
  return w[rows["w_gate"]], w[rows["w_up"]]
