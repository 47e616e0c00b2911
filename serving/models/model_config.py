"""Model architecture description, read from a Hugging Face `config.json`.

One frozen dataclass describes every family: the shape, and the generic
switches the runner and the shared layers read (per-layer attention kinds,
soft caps, sinks, score scale). Checkpoint loaders (HF directories, GGUF
metadata, orbax) all produce a HF-style config dict and call
`ModelConfig.from_hf_config`, which asks the family registry
(serving/models/registry.py) for the family's own parser, so architecture
support is decided there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

  rope_type: ClassVar[str] = "llama3"
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
  """Phi-3 LongRoPE (`rope_type` "longrope"; "su" in older configs).

  Each rotary frequency is divided by its factor from one of two sets, and
  cos / sin are multiplied by `attention_factor`. `transformers` picks the set
  per forward call from the sequence length (long once it exceeds
  `original_max_position_embeddings`); a batch of sequences of any lengths
  shares one set here, so the set is fixed per engine as vLLM fixes it: long
  when the engine's `max_model_len` exceeds `original_max_position_embeddings`
  (`ModelConfig.for_max_model_len`). Outputs equal `transformers`' where its
  choice for the sequence's length is the same.
  """

  rope_type: ClassVar[str] = "longrope"
  short_factor: tuple[float, ...]
  long_factor: tuple[float, ...]
  original_max_position_embeddings: int
  attention_factor: float
  use_long: bool

  @property
  def factors(self) -> tuple[float, ...]:
    """The factor set in use."""
    return self.long_factor if self.use_long else self.short_factor


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN frequency scaling (`rope_type == "yarn"`), resolved as transformers'
  `_compute_yarn_parameters` does (serving/models/gpt_oss.py parses it):
  `attention_factor` multiplies cos and sin."""

  factor: float
  beta_fast: float
  beta_slow: float
  original_max_position_embeddings: int
  truncate: bool
  attention_factor: float
  rope_type: ClassVar[str] = "yarn"


MOE_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """Multi-head latent attention and DeepSeek MoE routing (serving/models/deepseek.py).

  The KV cache of such a model holds one latent row per token per layer,
  `kv_lora_rank + qk_rope_head_dim` wide (`ModelConfig.head_dim`, one KV head,
  no separate values: serving/runner/mla_attention.py).
  """

  q_lora_rank: int | None  # None: a direct q projection
  kv_lora_rank: int  # R, the latent
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rope_interleave: bool  # RoPE over interleaved pairs (x0, x1), (x2, x3), ...
  first_k_dense_replace: int  # the first layers are dense MLPs
  dense_intermediate_size: int  # their MLP width
  shared_intermediate_size: int  # the shared experts' MLP width (moe_intermediate * n_shared)
  n_group: int  # expert groups for group-limited routing
  topk_group: int  # groups kept per token
  routed_scaling_factor: float

  @property
  def latent_dim(self) -> int:
    """The cached row: latent plus the roped key."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def mlp_width(self) -> int:
    """The dense / shared MLP keys' width: both kinds of layer zero-pad theirs to it."""
    return max(self.dense_intermediate_size, self.shared_intermediate_size)


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation (`rope_type == "linear"`): every frequency divided by `factor`."""

  rope_type: ClassVar[str] = "linear"
  factor: float


# rope_type -> its scaling class (checkpoints/orbax_io.py reads configs back with it).
ROPE_SCALINGS = {cls.rope_type: cls for cls in (RopeScaling, LinearRopeScaling, LongRopeScaling,
                                               YarnScaling)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A model's architecture (see module doc); hashable, so jit can take it as static."""

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
  rope_scaling: RopeScaling | LinearRopeScaling | LongRopeScaling | YarnScaling | None = None
  # Rotary embedding on the first `rotary_dim` = int(head_dim * factor) dims of each head.
  partial_rotary_factor: float = 1.0
  # RoPE base of the sliding-window layers, unscaled (Gemma 3); None: as the full layers.
  local_rope_theta: float | None = None
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
  # The family module (serving/models/registry.py) that defines the layers.
  family: str = "llama"
  # Per layer "full_attention" | "sliding_attention"; () = every layer uses
  # `sliding_window` (None: full attention everywhere).
  layer_types: tuple[str, ...] = ()
  attn_soft_cap: float | None = None  # tanh soft-capping of attention scores
  final_soft_cap: float | None = None  # tanh soft-capping of the final logits
  attn_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
  attention_sinks: bool = False  # per-head learned sink logits (params "sinks" [L, N])
  # The experts' gated activation: "silu" (silu(gate) * up) or "clamped_swiglu"
  # (GPT-OSS: gate clamped above at `swiglu_limit`, up to [-limit, limit],
  # (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
  moe_activation: str = "silu"
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  # Multi-head latent attention (DeepSeek-V2/V3): a latent KV cache; None elsewhere.
  mla: MlaConfig | None = None
  # Gated DeltaNet linear attention (serving/models/qwen3_next.py): each of the
  # num_layers blocks is `linear_layers_per_block` linear-attention layers, then one
  # full-attention layer (0: no linear layers). Their per-sequence states live in the
  # runner's state slots (serving/runner/state_cache.py); prefill runs the chunked rule
  # over blocks of `linear_chunk_size` tokens.
  linear_layers_per_block: int = 0
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 0
  linear_chunk_size: int = 64
  shared_expert_intermediate_size: int = 0  # MoE shared expert (0: none)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim="
                       f"{self.rotary_dim}: it must be even and in (0, head_dim={self.head_dim}]")
    rs = self.rope_scaling
    if isinstance(rs, LongRopeScaling):
      for name, factors in (("short_factor", rs.short_factor), ("long_factor", rs.long_factor)):
        if len(factors) != self.rotary_dim // 2:
          raise ValueError(f"longrope {name} has {len(factors)} entries; "
                           f"rotary_dim={self.rotary_dim} needs {self.rotary_dim // 2}")
    if self.moe_activation not in MOE_ACTIVATIONS:
      raise ValueError(f"unsupported moe_activation {self.moe_activation!r} (supported: "
                       f"{MOE_ACTIVATIONS})")

  @property
  def has_state_slots(self) -> bool:
    """Linear-attention layers: every running sequence needs a state slot."""
    return self.linear_layers_per_block > 0

  def state_bytes_per_sequence(self) -> int:
    """Bytes of one sequence's linear-attention states (float32 conv inputs and
    recurrent states) over every linear layer."""
    nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
    dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
    conv = (self.linear_conv_kernel - 1) * (2 * nk * dk + nv * dv)
    return 4 * self.num_layers * self.linear_layers_per_block * (conv + nv * dk * dv)

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer` (None: full attention)."""
    if not self.layer_types:
      return self.sliding_window
    return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

  @property
  def layer_windows(self) -> tuple[int | None, ...]:
    return tuple(self.layer_window(i) for i in range(self.num_layers))

  @property
  def is_hybrid(self) -> bool:
    """Both full-attention and sliding-window layers."""
    return len(set(self.layer_windows)) > 1

  @property
  def scale(self) -> float:
    """The attention score scale."""
    return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def rotary_dim(self) -> int:
    """Dims of each head the rotary embedding turns (the rest pass through)."""
    return int(self.head_dim * self.partial_rotary_factor)

  def for_max_model_len(self, max_model_len: int) -> ModelConfig:
    """This config as an engine of `max_model_len` serves it: LongRoPE takes its long
    factors exactly when `max_model_len` exceeds the original context (vLLM's rule)."""
    rs = self.rope_scaling
    if not isinstance(rs, LongRopeScaling):
      return self
    use_long = max_model_len > rs.original_max_position_embeddings
    return dataclasses.replace(self, rope_scaling=dataclasses.replace(rs, use_long=use_long))

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
    if self.mla is not None:  # one latent row per token per layer, no separate values
      return self.num_layers * self.mla.latent_dim * itemsize
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

  @classmethod
  def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a HF config dict through its family's parser;
    an unsupported architecture raises ValueError naming the supported ones."""
    from serving.models import registry  # the families import this module
    return registry.family_for_hf(cfg).config_from_hf(cfg)


def parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
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


def hf_rope_theta(cfg: dict[str, Any], key: str = "rope_theta") -> float:
  """RoPE base `key` of a HF config, or transformers 5's `rope_parameters[key]`."""
  theta = cfg.get(key)
  if theta is None:
    theta = (cfg.get("rope_parameters") or {}).get(key, 10000.0)
  return float(theta)


def hf_eos_token_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
  """`eos_token_id` of a HF config (one id or a list) as a tuple."""
  eos = cfg.get("eos_token_id")
  return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


LAYER_TYPES = ("full_attention", "sliding_attention")


def hf_layer_types(cfg: dict[str, Any], sliding_window: int | None) -> tuple[str, ...]:
  """Per-layer attention kinds of a HF config (`layer_types`); () when the config
  has none or no window (then `sliding_window` applies to every layer, or none).
  An unknown kind raises ValueError naming the supported ones."""
  kinds = tuple(cfg.get("layer_types") or ())
  unknown = sorted(set(kinds) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"unsupported layer type(s) {unknown}; supported: {list(LAYER_TYPES)}")
  if sliding_window is None or not kinds:
    return ()
  if len(kinds) != cfg["num_hidden_layers"]:
    raise ValueError(f"layer_types has {len(kinds)} entries for "
                     f"{cfg['num_hidden_layers']} layers")
  return kinds
