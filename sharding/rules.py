"""Logical axis names, the ONE table mapping them to mesh axes, and partition specs.

Every params leaf (docs/structure.md) names its dimensions with logical axes
(`PARAM_AXES`); `LOGICAL_AXIS_RULES` maps a logical axis to a mesh axis.
`resolve_rules(cfg, mesh)` drops a mapping whose dimension the mesh axis does
not divide (the dimension is then replicated: "shard what divides"), and
`param_specs` / `kv_cache_spec` turn the names into `PartitionSpec`s.

Tensor parallelism is the Megatron layout: wq/wk/wv and w_gate/w_up are
column-parallel (heads / mlp columns over `tp`), wo and w_down row-parallel
(their outputs are partial sums, all-reduced over `tp`). MoE experts are
split over `ep` and each expert's mlp columns over `tp`. Pipeline stages
split the stacked layer axis and the page pool (layer-major) over `pp`
(pipeline.py).

KV heads: when `tp` exceeds the KV head count K (and is a multiple of it),
each KV head is repeated `tp // K` times (`replicate_kv_heads`) so every
device holds exactly one head of the cache next to its query heads. When the
head counts do not divide `tp` at all, attention (its weights and the KV
cache) is replicated and only the MLP / vocab / experts are split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.models.model_config import ModelConfig
from serving.models.quantized import QuantizedWeight, is_quantized
from sharding.mesh import axis_size

Params = dict[str, Any]
Rules = dict[str, str | None]

# The one table: logical axis -> mesh axis (None: replicated).
LOGICAL_AXIS_RULES: Rules = {
    "layers": "pp",  # L, the stacked layer axis: pipeline stages
    "embed": None,  # D, the residual stream
    "vocab": "tp",  # V, embedding rows and lm_head columns
    "heads": "tp",  # N*H, query heads
    "q_heads": "tp",  # N, one value per query head (attention sinks)
    "kv_heads": "tp",  # K*H, key/value heads (also the KV cache's K axis)
    "head_dim": None,  # H
    "mlp": "tp",  # F, dense MLP columns
    "expert": "ep",  # E, MoE experts
    "expert_mlp": "tp",  # M, columns inside one expert
    "router_out": None,  # E as the router's output (tiny, replicated)
    "cache_pages": "pp",  # L*P, the page pool (layer-major: a stage's layers' pages)
    "page": None,  # page_size
    "lora_slot": None,  # S, resident LoRA adapters
    "lora_rank": None,  # R, the slots' LoRA rank
    "latent": None,  # MLA's q / kv LoRA ranks (the latent cache is replicated)
    # Qwen3-Next blocks (serving/models/qwen3_next.py): the sub-layer axis of a block's
    # weights, linear-attention columns grouped per key head, the shared expert's columns.
    "sublayer": None,
    "conv_tap": None,  # the linear layers' conv kernel taps
    "lin_head_dim": None,  # a value head's dims (the gated norm's weight)
    "gate_out": None,  # the shared expert gate's one output
    "lin_heads": "tp",
    "shared_mlp": "tp",
}

# Logical axes of every params leaf, without the leading "layers" axis.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "post_attn_norm": ("embed",),
    "post_mlp_norm": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "router": ("embed", "router_out"),
    "we_gate": ("expert", "embed", "expert_mlp"),
    "we_up": ("expert", "embed", "expert_mlp"),
    "we_down": ("expert", "expert_mlp", "embed"),
    # GPT-OSS: output bias, per-head sinks, router and expert biases. The down bias is
    # added after the experts' psum (every token's k experts), so it stays replicated.
    "bo": ("embed",),
    "sinks": ("q_heads",),
    "router_bias": ("router_out",),
    "be_gate": ("expert", "expert_mlp"),
    "be_up": ("expert", "expert_mlp"),
    "be_down": ("router_out", "embed"),
    # DeepSeek MLA (serving/models/deepseek.py): the down-projections to the latents and
    # their norms are replicated, the per-head up-projections split with the heads.
    "wq_a": ("embed", "latent"),
    "q_a_norm": ("latent",),
    "wq_b": ("latent", "heads"),
    "wkv_a": ("embed", "latent"),
    "kv_a_norm": ("latent",),
    "w_uk": ("latent", "heads"),
    "w_uv": ("latent", "heads"),
    # Qwen3-Next (a block: J linear-attention layers, then a gated full-attention layer;
    # `sub_*` leaves have one entry per layer of the block).
    "wq_gate": ("embed", "heads"),
    "lin_qkv": ("sublayer", "embed", "lin_heads"),
    "lin_z": ("sublayer", "embed", "lin_heads"),
    "lin_b": ("sublayer", "embed", "lin_heads"),
    "lin_a": ("sublayer", "embed", "lin_heads"),
    "lin_conv": ("sublayer", "conv_tap", "lin_heads"),
    "lin_dt_bias": ("sublayer", "lin_heads"),
    "lin_a_log": ("sublayer", "lin_heads"),
    "lin_norm": ("sublayer", "lin_head_dim"),
    "lin_out": ("sublayer", "lin_heads", "embed"),
    "sub_attn_norm": ("sublayer", "embed"),
    "sub_mlp_norm": ("sublayer", "embed"),
    "sub_router": ("sublayer", "embed", "router_out"),
    "sub_we_gate": ("sublayer", "expert", "embed", "expert_mlp"),
    "sub_we_up": ("sublayer", "expert", "embed", "expert_mlp"),
    "sub_we_down": ("sublayer", "expert", "expert_mlp", "embed"),
    "sub_ws_gate": ("sublayer", "embed", "shared_mlp"),
    "sub_ws_up": ("sublayer", "embed", "shared_mlp"),
    "sub_ws_down": ("sublayer", "shared_mlp", "embed"),
    "sub_ws_router": ("sublayer", "embed", "gate_out"),
    "sub_w_gate": ("sublayer", "embed", "mlp"),
    "sub_w_up": ("sublayer", "embed", "mlp"),
    "sub_w_down": ("sublayer", "mlp", "embed"),
}
KV_CACHE_AXES = ("cache_pages", "page", "kv_heads", "head_dim")  # [L*P, page_size, K, H]


def resolve_rules(cfg: ModelConfig, mesh) -> Rules:
  """LOGICAL_AXIS_RULES for this model on this mesh: mappings that do not divide -> None."""
  rules = {k: (v if axis_size(mesh, v) > 1 else None) for k, v in LOGICAL_AXIS_RULES.items()}

  def keep_if(names: tuple[str, ...], *counts: int) -> None:
    for name in names:
      size = axis_size(mesh, rules[name])
      if any(c % size for c in counts):
        rules[name] = None

  keep_if(("layers", "cache_pages"), cfg.num_layers)  # pipeline.pad_layers makes pp divide
  keep_if(("vocab",), cfg.vocab_size)
  if cfg.mla is not None:
    # MLA: heads split, the one latent "KV head" (the cache) replicated on every device.
    keep_if(("heads", "q_heads"), cfg.num_heads)
    keep_if(("mlp",), cfg.intermediate_size)  # the dense MLP / shared experts
    rules["kv_heads"] = None
  else:
    # Whole heads per device, and query and KV heads split alike (GQA groups stay local).
    keep_if(("heads", "kv_heads", "q_heads"), cfg.num_heads, cfg.num_kv_heads)
  keep_if(("lin_heads",), cfg.linear_num_key_heads)  # whole key-head groups per device
  keep_if(("shared_mlp",), cfg.shared_expert_intermediate_size)
  if cfg.is_moe:
    keep_if(("expert",), cfg.num_experts)
    keep_if(("expert_mlp",), cfg.moe_intermediate_size)
  else:
    keep_if(("mlp",), cfg.intermediate_size)
  return rules


def logical_spec(names: tuple[str | None, ...], rules: Rules) -> P:
  """Logical axis names -> PartitionSpec under `rules` (None names stay None)."""
  return P(*(None if n is None else rules[n] for n in names))


def param_specs(params: Params, cfg: ModelConfig, mesh) -> Params:
  """PartitionSpecs mirroring `params`: stacked `layers` dict or per-layer list form.

  A quantized leaf gets a `QuantizedWeight` of specs (`weight_spec`).
  """
  rules = resolve_rules(cfg, mesh)

  def spec(names: tuple[str, ...], value: Any):
    if not is_quantized(value):
      return logical_spec(names, rules)
    *lead, d_in, d_out = (rules[n] for n in names)
    return weight_spec(value, tuple(lead), d_in, d_out, axis_size(mesh, d_in))

  out: Params = {}
  for key, value in params.items():
    if key != "layers":
      out[key] = spec(PARAM_AXES[key], value)
    elif isinstance(value, (list, tuple)):
      out[key] = [{k: spec(PARAM_AXES[k], v) for k, v in lp.items()} for lp in value]
    else:
      out[key] = {k: spec(("layers", *PARAM_AXES[k]), v) for k, v in value.items()}
  return out


def weight_spec(w: QuantizedWeight, lead: tuple[str | None, ...], in_axis: str | None,
                out_axis: str | None, in_shards: int) -> QuantizedWeight:
  """Specs of a quantized `[..., In, Out]` weight's arrays (stored `[..., Out, In]`).

  Codes and per-group scales split with their weight: along Out as the
  weight's output axis, along In only when every shard holds whole groups
  (and whole super-blocks); otherwise the input axis stays replicated and
  XLA gathers what the matmul needs. A per-channel scale follows Out; an
  act-order `perm` is replicated.
  """
  whole = max(w.group_size, w.super_size, 8)
  if in_axis is not None and (w.in_features // in_shards) % whole:
    in_axis = None
  rows, per_row = P(*lead, out_axis, in_axis), P(*lead, out_axis)
  specs = {f: rows for f in w.arrays()}
  if w.group_size == 0:
    specs["scale"] = per_row
  if w.perm is not None:
    specs["perm"] = P(*lead, None)
  return QuantizedWeight(**specs, kind=w.kind, group_size=w.group_size,
                         super_size=w.super_size)


def param_shardings(params: Params, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Params:
  """NamedShardings mirroring `params` (see `param_specs`)."""
  return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s),
                      param_specs(params, cfg, mesh), is_leaf=lambda x: isinstance(x, P))


def kv_cache_spec(cfg: ModelConfig, mesh) -> P:
  """PartitionSpec of the `[L*P, page_size, K, H]` page pool: K over `tp` when it divides."""
  return logical_spec(KV_CACHE_AXES, resolve_rules(cfg, mesh))


def kv_head_replicas(cfg: ModelConfig, tp: int) -> int:
  """How many times to repeat each KV head so `tp` splits whole heads (1: no repeat).

  Applies when K < tp, tp % K == 0 and N % tp == 0; otherwise the head
  counts either divide tp already or attention stays replicated.
  """
  k, n = cfg.num_kv_heads, cfg.num_heads
  if cfg.mla is not None:  # the latent cache is replicated, never repeated
    return 1
  if k < tp and tp % k == 0 and n % tp == 0:
    return tp // k
  return 1


def with_kv_replicas(cfg: ModelConfig, replicas: int) -> ModelConfig:
  """`cfg` after `replicate_kv_heads` (K * replicas KV heads)."""
  return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)


def replicate_kv_heads(params: Params, cfg: ModelConfig,
                       replicas: int) -> tuple[Params, ModelConfig]:
  """Repeats each KV head `replicas` times in wk/wv/bk/bv -> (params, cfg with K*replicas).

  Copy j of head h becomes head h*replicas + j, so query head i (group
  i // (N/K) originally) reads the same keys: GQA semantics are unchanged.
  """
  if replicas == 1:
    return params, cfg
  def layer(lp: Params) -> Params:
    return {k: repeat_kv_heads(v, cfg.head_dim, replicas) if k in ("wk", "wv", "bk", "bv")
            else v for k, v in lp.items()}

  layers = params["layers"]
  layers = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
  return {**params, "layers": layers}, with_kv_replicas(cfg, replicas)


def repeat_kv_heads(x: Any, head_dim: int, replicas: int) -> Any:
  """[..., K*H] -> [..., K*replicas*H]: each head's columns repeated (see above)."""
  if replicas == 1:
    return x
  xp = jnp if isinstance(x, jax.Array) else np
  heads = x.reshape(*x.shape[:-1], -1, head_dim)  # [..., K, H]
  return xp.repeat(heads, replicas, axis=-2).reshape(*x.shape[:-1], -1)


def lora_specs(lora: Any, cfg: ModelConfig, mesh) -> Any:
  """PartitionSpecs of the LoRA slots (serving/runner/lora_state.py), split like their
  base weights: A [In, S, R] along the base weight's input axis, B [S, R, Out]
  along its output axis; the slot and rank axes are replicated."""
  rules = resolve_rules(cfg, mesh)

  def specs(key: str, stacked: bool) -> tuple[P, P]:
    d_in, d_out = PARAM_AXES[key]
    lead = ("layers",) if stacked else ()
    return (logical_spec((*lead, d_in, "lora_slot", "lora_rank"), rules),
            logical_spec((*lead, "lora_slot", "lora_rank", d_out), rules))

  if isinstance(lora, (list, tuple)):
    return [{k: specs(k, False) for k in lp} for lp in lora]
  return {k: specs(k, True) for k in lora}
