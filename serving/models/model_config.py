"""Model architecture description, read from a Hugging Face `config.json`.

One frozen dataclass covers the Llama family (Llama 2/3/3.1, Mistral, Qwen2,
Qwen3, SmolLM2) and the MoE models (Mixtral, Qwen3-MoE). Checkpoint loaders
(HF directories, GGUF metadata, orbax) all produce a HF-style config dict and
call `ModelConfig.from_hf_config`, so architecture support is decided here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# model_type -> (qkv_bias, qk_norm, moe)
SUPPORTED_MODEL_TYPES = {
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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  # Mixture of experts (0 experts: dense MLP).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def num_params(self) -> int:
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.is_moe:
      mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
    else:
      mlp = 3 * d * f
    head = 0 if self.tie_word_embeddings else d * v
    return v * d + head + self.num_layers * (attn + mlp + 2 * d) + d

  def kv_bytes_per_token(self, itemsize: int) -> int:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

  @classmethod
  def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a HF config dict; unsupported models raise."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      archs = cfg.get("architectures") or []
      model_type = next((ARCHITECTURE_TO_TYPE[a] for a in archs if a in ARCHITECTURE_TO_TYPE),
                        None)
    if model_type is None:
      raise ValueError(
          f"unsupported architecture: model_type={cfg.get('model_type')!r}, "
          f"architectures={cfg.get('architectures')}; supported model types: "
          f"{sorted(SUPPORTED_MODEL_TYPES)}")
    qkv_bias, qk_norm, moe = SUPPORTED_MODEL_TYPES[model_type]
    qkv_bias = bool(cfg.get("attention_bias", qkv_bias))
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    rope_scaling = _parse_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters"))
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:
      rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    sliding = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
      sliding = None
    return cls(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 0),
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=sliding,
        num_experts=(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if moe else 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=(cfg.get("moe_intermediate_size")
                               or cfg.get("intermediate_size", 0)) if moe else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "mixtral")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
  if not rs:
    return None
  kind = rs.get("rope_type") or rs.get("type")
  if kind in (None, "default"):
    return None
  if kind != "llama3":
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: 'llama3')")
  return RopeScaling(
      factor=float(rs["factor"]),
      low_freq_factor=float(rs["low_freq_factor"]),
      high_freq_factor=float(rs["high_freq_factor"]),
      original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
