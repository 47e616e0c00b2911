"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5 text (`Qwen3_5ForCausalLM`, and the
language model of `Qwen3_5ForConditionalGeneration`) as a flax nnx family: Gated
DeltaNet linear attention with a gated full-attention layer every few layers; MoE with
a shared expert (Qwen3-Next) or a dense SwiGLU MLP (Qwen3.5, Qwen3-Next without experts).

Qwen3.5's text layers are Qwen3-Next's with the linear layers' projections stored
apart (`in_proj_qkv` with all queries, then keys, then values; `in_proj_z`,
`in_proj_b`, `in_proj_a`) rather than fused per key head; the loader regroups them
into the same leaves. Its multimodal RoPE (`mrope_section`) turns text positions
exactly as plain RoPE does (the three position axes are equal), so text-only
serving uses plain RoPE; vision and multi-token-prediction (`mtp.*`) weights are
not loaded.

Layers come in **blocks**: `linear_layers_per_block` (J) linear-attention layers then
one full-attention layer (HF `layer_types`, or `full_attention_interval` = J + 1; any
other pattern is refused). A block is one `DecoderLayer` here, so the stacked params
(`[G, ...]`, G = blocks), the scan over layers, placement and the KV cache see a
uniform stack whose "layers" are the G full-attention layers: the page pool holds
exactly their K/V, and `ModelConfig.num_layers` counts blocks. Per-sub-layer weights
carry a leading sub-layer axis: `[J, ...]` for the linear layers' own, `[J + 1, ...]`
(`sub_*`) for the norms and MLPs every layer has.

Linear layers (serving/models/gated_delta.py): `lin_qkv` projects to, per key head, its
query, key and its r = NV / NK value heads' values (the checkpoint's `in_proj_qkvz`
grouping, so tensor parallelism splits whole key-head groups), a causal depthwise conv
(`lin_conv`, same channel order) and silu, l2-normed q / k, decay
`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)`, the gated delta rule
over the sequence's state slot, an RMSNorm per value head gated by silu(z), `lin_out`.
The layer threads a `gated_delta.StateCarry` (the runner's KV cache plus the state
slots) where other families thread the KV cache.

Full-attention layers: q_proj's per-head halves are the query and an output gate
(`wq`, `wq_gate`: attention output * sigmoid(gate)), q / k RMSNorms, RoPE on the
first `partial_rotary_factor` of each head. Every RMSNorm outside the linear layers
scales by (1 + w). MLP: top-k softmax MoE plus a shared expert weighted by
sigmoid(x @ w), or a dense SwiGLU when the config has no experts.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models import gated_delta
from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, param, value
from serving.models.model_config import ModelConfig, hf_eos_token_ids, hf_rope_theta

FAMILY = "qwen3_next"
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5")  # Qwen3.5: separate linear projections, dense
LAYER_KINDS = ("linear_attention", "full_attention")


class Qwen3NextBlock(DecoderLayer):
  """J linear-attention layers then one gated full-attention layer (see module doc)."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    d, h, j = cfg.hidden_size, cfg.head_dim, cfg.linear_layers_per_block
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    f = nk * 2 * dk + nv * dv
    self.lin_qkv, self.lin_z = param(j, d, f), param(j, d, nv * dv)
    self.lin_b, self.lin_a = param(j, d, nv), param(j, d, nv)
    self.lin_conv = param(j, cfg.linear_conv_kernel, f)
    self.lin_dt_bias, self.lin_a_log = param(j, nv), param(j, nv)
    self.lin_norm, self.lin_out = param(j, dv), param(j, nv * dv, d)
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    self.wq, self.wq_gate, self.wk, self.wv = param(d, nh), param(d, nh), param(d, kh), param(d, kh)
    self.wo, self.q_norm, self.k_norm = param(nh, d), param(h), param(h)
    i = j + 1
    self.sub_attn_norm, self.sub_mlp_norm = param(i, d), param(i, d)
    if cfg.is_moe:
      e, m, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
      self.sub_router = param(i, d, e)
      self.sub_we_gate, self.sub_we_up, self.sub_we_down = (
          param(i, e, d, m), param(i, e, d, m), param(i, e, m, d))
      self.sub_ws_gate, self.sub_ws_up, self.sub_ws_down = (
          param(i, d, s), param(i, d, s), param(i, s, d))
      self.sub_ws_router = param(i, d, 1)
    else:
      f_mlp = cfg.intermediate_size
      self.sub_w_gate, self.sub_w_up, self.sub_w_down = (
          param(i, d, f_mlp), param(i, d, f_mlp), param(i, f_mlp, d))

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    for j in range(cfg.linear_layers_per_block):
      out, kv = self.linear_attention(self.norm(h, j), layer, j, kv)
      h = h + out
      h = h + self.mlp(self.norm(h, j, "mlp"), j, experts_fn)
    j = cfg.linear_layers_per_block
    out, kv = self.full_attention(self.norm(h, j), positions, rope, layer, kv, attend)
    h = h + out
    return h + self.mlp(self.norm(h, j, "mlp"), j, experts_fn), kv

  def norm(self, h: jax.Array, j: int, which: str = "attn") -> jax.Array:
    """Sub-layer j's (1 + w) RMSNorm before its attention or its MLP."""
    w = value(self.sub_attn_norm if which == "attn" else self.sub_mlp_norm)[j]
    return L.rms_norm_plus_one(h, w, self.cfg.rms_norm_eps)

  def linear_attention(self, x: jax.Array, layer, j: int, carry: gated_delta.StateCarry
                       ) -> tuple[jax.Array, gated_delta.StateCarry]:
    """Linear layer j of the block over x [T, D] (normed) -> (out [T, D], carry)."""
    cfg = self.cfg
    t, nk, nv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = L.linear(x, value(self.lin_qkv)[j]).reshape(t, nk, -1)  # [T, NK, 2dk + r*dv]
    a, b = L.linear(x, value(self.lin_a)[j]), L.linear(x, value(self.lin_b)[j])  # [T, NV]
    core, carry = gated_delta.mix(carry, layer, j, qkv, value(self.lin_conv)[j], a, b,
                                  value(self.lin_a_log)[j], value(self.lin_dt_bias)[j], dk)
    z = L.linear(x, value(self.lin_z)[j]).reshape(t, nv, dv)
    normed = L.rms_norm(core, value(self.lin_norm)[j], cfg.rms_norm_eps)  # per value head
    gated = (normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    # [T, NV, dv] -> [T, NV*dv]
    return L.linear(gated.reshape(t, nv * dv), value(self.lin_out)[j]), carry

  def full_attention(self, x, positions, rope, layer, carry, attend):
    """The gated full-attention layer over x [T, D] (normed) -> (out [T, D], carry)."""
    cfg = self.cfg
    q, k, v = L.qkv_heads(cfg, x, value(self.wq), value(self.wk), value(self.wv))
    q = L.rms_norm_plus_one(q, value(self.q_norm), cfg.rms_norm_eps)
    k = L.rms_norm_plus_one(k, value(self.k_norm), cfg.rms_norm_eps)
    q, k = L.apply_rope(q, positions, rope), L.apply_rope(k, positions, rope)
    out, carry = attend(layer, q, k, v, carry)
    gate = jax.nn.sigmoid(L.linear(x, value(self.wq_gate)).astype(jnp.float32))  # [T, N*H]
    t = x.shape[0]
    # [T, N, H] -> [T, N*H]
    gated = (out.reshape(t, -1).astype(jnp.float32) * gate).astype(x.dtype)
    return L.linear(gated, value(self.wo)), carry

  def mlp(self, x: jax.Array, j: int, experts_fn) -> jax.Array:
    """Sub-layer j's MLP: routed experts plus the gated shared expert, or dense SwiGLU."""
    cfg = self.cfg
    if not cfg.is_moe:
      return L.gated_mlp(x, value(self.sub_w_gate)[j], value(self.sub_w_up)[j],
                         value(self.sub_w_down)[j])
    experts = tuple(value(w)[j] for w in (self.sub_we_gate, self.sub_we_up, self.sub_we_down))
    routed = L.moe_mlp(cfg, value(self.sub_router)[j], experts, x, experts_fn)
    shared = L.gated_mlp(x, value(self.sub_ws_gate)[j], value(self.sub_ws_up)[j],
                         value(self.sub_ws_down)[j])
    weight = jax.nn.sigmoid(L.linear(x, value(self.sub_ws_router)[j]).astype(jnp.float32))
    return (routed.astype(jnp.float32) + weight * shared.astype(jnp.float32)).astype(x.dtype)


class Model(CausalLM):
  """Qwen3-Next: embedding, blocks, final (1 + w) RMSNorm, head."""

  layer_class = Qwen3NextBlock

  def norm(self, x: jax.Array) -> jax.Array:
    return L.rms_norm_plus_one(x, value(self.final_norm), self.cfg.rms_norm_eps)


def _need(raw: dict[str, Any], key: str) -> Any:
  if raw.get(key) is None:
    raise ValueError(f"qwen3_next config is missing {key!r}")
  return raw[key]


def layer_pattern(raw: dict[str, Any]) -> int:
  """J, the linear layers per block, from `layer_types` (or `full_attention_interval`);
  ValueError for an unknown kind or a pattern that is not J linear then one full."""
  n = _need(raw, "num_hidden_layers")
  kinds = raw.get("layer_types")
  if kinds is None:
    interval = raw.get("full_attention_interval", 4)
    kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
  unknown = sorted(set(kinds) - set(LAYER_KINDS))
  if unknown:
    raise ValueError(f"unsupported layer type(s) {unknown}; supported: {list(LAYER_KINDS)}")
  if len(kinds) != n or "full_attention" not in kinds:
    raise ValueError(f"layer_types {kinds} do not give {n} layers ending in full attention")
  j = kinds.index("full_attention")
  block = ["linear_attention"] * j + ["full_attention"]
  if n % (j + 1) or kinds != block * (n // (j + 1)):
    raise ValueError(f"unsupported layer pattern {kinds}: supported are blocks of linear "
                     "attention layers each ending in one full-attention layer")
  return j


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a Qwen3-Next HF config dict (module doc); ValueError naming a
  missing key or an unsupported layer pattern / MLP layout / activation."""
  j = layer_pattern(raw)
  n = raw["num_hidden_layers"]
  model_type = raw.get("model_type") or FAMILY
  if model_type not in (FAMILY, *QWEN3_5_TYPES):
    archs = raw.get("architectures") or []
    model_type = QWEN3_5_TYPES[0] if any(a.startswith("Qwen3_5") for a in archs) else FAMILY
  moe = model_type == FAMILY and (raw.get("num_experts") or 0) > 0
  if moe and (raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1):
    raise ValueError("unsupported qwen3_next MLP layout: mlp_only_layers / decoder_sparse_step "
                     "must leave every layer MoE")
  if raw.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (supported: 'silu')")
  if raw.get("attention_bias"):
    raise ValueError("unsupported qwen3_next attention_bias=True")
  rope = raw.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    raise ValueError(f"unsupported rope_type {rope['rope_type']!r} (supported: 'default')")
  heads = _need(raw, "num_attention_heads")
  hidden = _need(raw, "hidden_size")
  return ModelConfig(
      model_type=model_type, family=FAMILY,
      vocab_size=_need(raw, "vocab_size"), hidden_size=hidden,
      intermediate_size=raw.get("intermediate_size", 0) if not moe else 0,
      num_layers=n // (j + 1), num_heads=heads,
      num_kv_heads=raw.get("num_key_value_heads") or heads,
      head_dim=raw.get("head_dim") or hidden // heads,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
      rope_theta=hf_rope_theta(raw),
      partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                           raw.get("partial_rotary_factor", 0.25))),
      max_position_embeddings=raw.get("max_position_embeddings", 4096),
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
      num_experts=raw["num_experts"] if moe else 0,
      num_experts_per_tok=_need(raw, "num_experts_per_tok") if moe else 0,
      moe_intermediate_size=_need(raw, "moe_intermediate_size") if moe else 0,
      norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=hf_eos_token_ids(raw),
      linear_layers_per_block=j,
      linear_num_key_heads=_need(raw, "linear_num_key_heads"),
      linear_num_value_heads=_need(raw, "linear_num_value_heads"),
      linear_key_head_dim=_need(raw, "linear_key_head_dim"),
      linear_value_head_dim=_need(raw, "linear_value_head_dim"),
      linear_conv_kernel=_need(raw, "linear_conv_kernel_dim"),
      shared_expert_intermediate_size=(_need(raw, "shared_expert_intermediate_size")
                                       if moe else 0))


# ---- HF checkpoint names (checkpoints/hf.py routes this family's tensors here) ----

_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
        "lm_head.weight": "lm_head"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NOT_LOADED = ("mtp.", "model.visual.")  # multi-token prediction, the vision tower
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# Per-layer tensors with one params leaf each: name -> (key, transpose, sub-layer axis).
_PLAIN = {
    "input_layernorm.weight": ("sub_attn_norm", False),
    "post_attention_layernorm.weight": ("sub_mlp_norm", False),
    "mlp.gate.weight": ("sub_router", True),
    "mlp.shared_expert.gate_proj.weight": ("sub_ws_gate", True),
    "mlp.shared_expert.up_proj.weight": ("sub_ws_up", True),
    "mlp.shared_expert.down_proj.weight": ("sub_ws_down", True),
    "mlp.shared_expert_gate.weight": ("sub_ws_router", True),
    "mlp.gate_proj.weight": ("sub_w_gate", True),
    "mlp.up_proj.weight": ("sub_w_up", True),
    "mlp.down_proj.weight": ("sub_w_down", True),
    "linear_attn.dt_bias": ("lin_dt_bias", False),
    "linear_attn.A_log": ("lin_a_log", False),
    "linear_attn.norm.weight": ("lin_norm", False),
    "linear_attn.out_proj.weight": ("lin_out", True),
    "linear_attn.in_proj_z.weight": ("lin_z", True),  # Qwen3.5
    "linear_attn.in_proj_b.weight": ("lin_b", True),
    "linear_attn.in_proj_a.weight": ("lin_a", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
}


def hf_tensors(cfg: ModelConfig, name: str, tensor: np.ndarray
               ) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
  """One HF tensor -> [(params key, index into the leaf, value)]: the index is () for a
  top-level leaf, (block,) or (block, sub-layer[, expert]) for a layer's. ValueError
  for a name this family does not have."""
  name = name.replace("model.language_model.", "model.", 1)  # Qwen3.5's multimodal layout
  if name.startswith(_NOT_LOADED):
    return []
  if name in _TOP:
    return [(_TOP[name], (), tensor.T if name == "lm_head.weight" else tensor)]
  m = _LAYER_RE.fullmatch(name)
  if m is None:
    raise ValueError(f"unsupported tensor {name!r} in a qwen3_next checkpoint")
  i, rest = int(m.group(1)), m.group(2)
  per = cfg.linear_layers_per_block + 1
  g, j = divmod(i, per)
  if em := _EXPERT_RE.fullmatch(rest):
    return [(f"sub_we_{em.group(2)}", (g, j, int(em.group(1))), tensor.T)]
  if rest == "mlp.experts.gate_up_proj":  # fused (transformers 5 in memory): [E, 2M, D]
    gate, up = np.split(tensor, 2, axis=1)
    return [("sub_we_gate", (g, j), gate.transpose(0, 2, 1)),
            ("sub_we_up", (g, j), up.transpose(0, 2, 1))]
  if rest == "mlp.experts.down_proj":  # fused: [E, D, M]
    return [("sub_we_down", (g, j), tensor.transpose(0, 2, 1))]
  if rest in _PLAIN:
    key, transpose = _PLAIN[rest]
    index = (g,) if not key.startswith(("sub_", "lin_")) else (g, j)
    return [(key, index, tensor.T if transpose else tensor)]
  if rest == "self_attn.q_proj.weight":  # [N * 2H, D]: per head its query, then its gate
    n, h = cfg.num_heads, cfg.head_dim
    both = tensor.reshape(n, 2, h, -1)
    q, gate = (both[:, s].reshape(n * h, -1).T for s in (0, 1))
    return [("wq", (g,), q), ("wq_gate", (g,), gate)]
  return [(key, (g, j), v) for key, v in _linear_attn(cfg, rest, tensor, name)]


def _linear_attn(cfg: ModelConfig, rest: str, tensor: np.ndarray, name: str):
  """A linear layer's fused projections and conv in our layout (module doc)."""
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
  if rest == "linear_attn.in_proj_qkvz.weight":  # [NK * (2dk + 2r*dv), D]
    per_head = tensor.reshape(nk, 2 * dk + 2 * r * dv, -1)
    qkv = per_head[:, :2 * dk + r * dv].reshape(-1, tensor.shape[-1])
    z = per_head[:, 2 * dk + r * dv:].reshape(-1, tensor.shape[-1])
    return [("lin_qkv", qkv.T), ("lin_z", z.T)]
  if rest == "linear_attn.in_proj_ba.weight":  # [NK * 2r, D]: per key head r b's, r a's
    per_head = tensor.reshape(nk, 2, r, -1)
    return [("lin_b", per_head[:, 0].reshape(nv, -1).T),
            ("lin_a", per_head[:, 1].reshape(nv, -1).T)]
  if rest == "linear_attn.conv1d.weight":  # [q (NK*dk) | k (NK*dk) | v (NV*dv), 1, Kc]
    return [("lin_conv", _per_key_head(tensor[:, 0, :], nk, dk, r * dv).T)]
  if rest == "linear_attn.in_proj_qkv.weight":  # Qwen3.5: the same row order, [F, D]
    return [("lin_qkv", _per_key_head(tensor, nk, dk, r * dv).T)]
  raise ValueError(f"unsupported tensor {name!r} in a qwen3_next checkpoint")


def _per_key_head(w: np.ndarray, nk: int, dk: int, vdim: int) -> np.ndarray:
  """Rows [q (NK*dk) | k (NK*dk) | v (NK*vdim)] -> per key head [q dk | k dk | v vdim]."""
  q, k, v = w[:nk * dk], w[nk * dk:2 * nk * dk], w[2 * nk * dk:]
  grouped = np.concatenate([q.reshape(nk, dk, -1), k.reshape(nk, dk, -1),
                            v.reshape(nk, vdim, -1)], axis=1)  # [NK, 2dk + vdim, cols]
  return grouped.reshape(-1, w.shape[-1])
