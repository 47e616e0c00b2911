"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) as flax nnx modules: multi-head latent
attention (MLA) over a latent KV cache, and DeepSeek's mixture of experts.

Following transformers' modeling_deepseek_v3:

- queries: `q_b(norm(q_a(x)))` with a q LoRA rank, or one `q_proj` without
  (V2-Lite's shape); each head's `qk_nope_head_dim` dims pass, its
  `qk_rope_head_dim` dims take RoPE;
- keys and values come from one latent per token: `kv_a_proj_with_mqa(x)`
  gives the latent c (`kv_lora_rank`, then RMS-normed) and one roped key
  k_pe shared by every head; `kv_b_proj` expands c into each head's k_nope
  and v;
- RoPE turns interleaved pairs (x0, x1), (x2, x3), ... when `rope_interleave`
  (the released checkpoints; rotate-half otherwise), YaRN with its
  attention factor on cos / sin, and `mscale_all_dim` folded into the
  softmax scale `(qk_nope + qk_rope) ** -0.5 * mscale ** 2`;
- the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the
  others routed experts plus shared experts; routing: sigmoid scores, plus
  `e_score_correction_bias` for the choice only, the `topk_group` best of
  `n_group` groups (each scored by its two best experts), the top k inside
  them, weights from the plain scores, renormalized (`norm_topk_prob`) and
  times `routed_scaling_factor`.

The cache holds, per token per layer, the normed latent and the roped key
(`MlaConfig.latent_dim` wide, one "KV head"), never per-head K/V. Attention
runs in the absorbed form (serving/runner/mla_attention.py): each head's
query nope part is mapped into the latent space through its slice of
`kv_b_proj`'s key rows (`w_uk`), scores are q_latent . c + q_pe . k_pe, the
softmax-weighted latent is mapped out through the value rows (`w_uv`), then
`o_proj`. Prefill chunks take the same form as decode: one cache format, one
attention path, exact against the expanded form up to rounding.

Params per layer: attention `wq` or `wq_a` / `q_a_norm` / `wq_b`, `wkv_a`,
`kv_a_norm`, `w_uk` [R, N*dn], `w_uv` [R, N*dv], `wo`; MLP `w_gate` / `w_up` /
`w_down` (the dense MLP, or the MoE layers' shared experts), `router`,
`router_bias` (e_score_correction_bias) and `we_*` (routed experts). Every
layer has every key (stacked params): the dense MLP and shared experts are
zero-padded to one width (`MlaConfig.mlp_width`), and the dense layers'
router and experts are zeros, never evaluated in an unrolled forward (and
adding exactly 0 under a scan). Dimension letters: T tokens, D model, N
heads, R kv_lora_rank, r qk_rope_head_dim, dn qk_nope_head_dim, dv v_head_dim.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models import gpt_oss
from serving.models import layers as L
from serving.models.causal_lm import CausalLM, DecoderLayer, param, value
from serving.models.model_config import MlaConfig, ModelConfig, YarnScaling, hf_eos_token_ids

FAMILY = "deepseek"
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
MOE_KEYS = ("moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group")


class DeepseekLayer(DecoderLayer):
  """Pre-norm multi-head latent attention, then a dense MLP or routed + shared experts."""

  def __init__(self, cfg: ModelConfig):
    super().__init__(cfg)
    m = cfg.mla
    d, n = cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    self.attn_norm, self.mlp_norm = param(d), param(d)
    if m.q_lora_rank is None:
      self.wq, self.wq_a, self.q_a_norm, self.wq_b = param(d, n * qk), None, None, None
    else:
      self.wq = None
      self.wq_a, self.q_a_norm = param(d, m.q_lora_rank), param(m.q_lora_rank)
      self.wq_b = param(m.q_lora_rank, n * qk)
    self.wkv_a, self.kv_a_norm = param(d, m.latent_dim), param(m.kv_lora_rank)
    self.w_uk = param(m.kv_lora_rank, n * m.qk_nope_head_dim)
    self.w_uv = param(m.kv_lora_rank, n * m.v_head_dim)
    self.wo = param(n * m.v_head_dim, d)
    f = m.mlp_width
    self.w_gate, self.w_up, self.w_down = param(d, f), param(d, f), param(f, d)
    if cfg.is_moe:
      e, mi = cfg.num_experts, cfg.moe_intermediate_size
      self.router, self.router_bias = param(d, e), param(e)
      self.we_gate, self.we_up, self.we_down = param(e, d, mi), param(e, d, mi), param(e, mi, d)
    else:
      self.router = self.router_bias = self.we_gate = self.we_up = self.we_down = None

  def __call__(self, h, positions, rope, layer, kv, attend, *, experts_fn=None, lora=None):
    cfg = self.cfg
    xn = L.rms_norm(h, value(self.attn_norm), cfg.rms_norm_eps)
    out, kv = self.attention(xn, positions, rope, layer, kv, attend)
    h = h + out
    hn = L.rms_norm(h, value(self.mlp_norm), cfg.rms_norm_eps)
    mlp = L.gated_mlp(hn, value(self.w_gate), value(self.w_up), value(self.w_down))
    dense = isinstance(layer, int) and layer < cfg.mla.first_k_dense_replace
    if cfg.is_moe and not dense:
      mlp = mlp + self.experts(hn, experts_fn)
    return h + mlp, kv

  def attention(self, xn, positions, rope, layer, kv, attend):
    """MLA over normed x [T, D] in the absorbed form -> (out [T, D], kv)."""
    cfg, m = self.cfg, self.cfg.mla
    t, n = xn.shape[0], cfg.num_heads
    if m.q_lora_rank is None:
      q = L.linear(xn, value(self.wq))
    else:
      qa = L.rms_norm(L.linear(xn, value(self.wq_a)), value(self.q_a_norm), cfg.rms_norm_eps)
      q = L.linear(qa, value(self.wq_b))
    q = q.reshape(t, n, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    ckv = L.linear(xn, value(self.wkv_a))
    c = L.rms_norm(ckv[:, :m.kv_lora_rank], value(self.kv_a_norm), cfg.rms_norm_eps)
    k_pe = ckv[:, None, m.kv_lora_rank:]  # [T, 1, r]
    inv_freq, scale = rope
    q_pe = L.apply_rope(deinterleave(q_pe, m), positions, inv_freq, scale)
    k_pe = L.apply_rope(deinterleave(k_pe, m), positions, inv_freq, scale)
    w_uk = dense_weight(value(self.w_uk), xn.dtype).reshape(m.kv_lora_rank, n, -1)
    q_lat = jnp.einsum("tnd,rnd->tnr", q_nope, w_uk, preferred_element_type=jnp.float32)
    q_abs = jnp.concatenate([q_lat.astype(q_pe.dtype), q_pe], axis=-1)  # [T, N, R + r]
    latent = jnp.concatenate([c[:, None, :], k_pe], axis=-1)  # [T, 1, R + r]
    out, kv = attend(layer, q_abs, latent, None, kv)  # [T, N, R]: weighted latents
    w_uv = dense_weight(value(self.w_uv), xn.dtype).reshape(m.kv_lora_rank, n, -1)
    o = jnp.einsum("tnr,rnv->tnv", out.astype(xn.dtype), w_uv,
                   preferred_element_type=jnp.float32)
    return L.linear(o.reshape(t, -1).astype(xn.dtype), value(self.wo)), kv

  def experts(self, x: jax.Array, experts_fn: L.ExpertsFn | None) -> jax.Array:
    """The routed experts over normed x [T, D] -> [T, D]."""
    cfg = self.cfg
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32),
                        dense_weight(value(self.router), jnp.float32))
    weights, ids = route_grouped(cfg, logits, value(self.router_bias).astype(jnp.float32))
    experts = (value(self.we_gate), value(self.we_up), value(self.we_down))
    if experts_fn is not None:
      out = experts_fn(x, weights, ids, experts)
    else:
      out = L.moe_experts(x, weights, ids, *experts)
    return out.astype(x.dtype)


class Model(CausalLM):
  """A DeepSeek-V3 model (embedding, DeepseekLayer stack, final RMSNorm, head)."""

  layer_class = DeepseekLayer

  def rope(self) -> Any:
    """(inverse frequencies [r/2] of the rope dims, the factor on cos and sin)."""
    return jnp.asarray(rope_inv_freq(self.cfg)), L.rope_attention_scale(self.cfg)


def dense_weight(w: Any, dtype) -> jax.Array:
  """A weight used outside `linear` (per-head einsums) as a dense array."""
  return w.dense(jnp.zeros((), dtype)) if hasattr(w, "dense") else w


def deinterleave(x: jax.Array, m: MlaConfig) -> jax.Array:
  """Rope dims in interleaved pairs -> the rotate-half layout (evens, then odds), as
  transformers' `apply_rotary_pos_emb_interleave` rotates them; unchanged otherwise."""
  if not m.rope_interleave:
    return x
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [r/2] over the rope dims (plain, or YaRN)."""
  r, theta = cfg.mla.qk_rope_head_dim, cfg.rope_theta
  if isinstance(cfg.rope_scaling, YarnScaling):
    return L.yarn_inv_freq(r, theta, cfg.rope_scaling)
  return (1.0 / (theta ** (np.arange(0, r, 2, dtype=np.int64).astype(np.float32) / r))
          ).astype(np.float32)


def route_grouped(cfg: ModelConfig, logits: jax.Array, bias: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3 routing: logits [T, E] f32 -> (weights [T, k] f32, ids [T, k]) (module doc)."""
  m, e, k = cfg.mla, cfg.num_experts, cfg.num_experts_per_tok
  scores = jax.nn.sigmoid(logits)
  choice = scores + bias[None, :]
  t = logits.shape[0]
  grouped = choice.reshape(t, m.n_group, e // m.n_group)
  group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, e // m.n_group))[0], axis=-1)
  _, groups = jax.lax.top_k(group_scores, m.topk_group)  # [T, topk_group]
  keep = jnp.zeros((t, m.n_group), bool).at[jnp.arange(t)[:, None], groups].set(True)
  choice = jnp.where(jnp.repeat(keep, e // m.n_group, axis=1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, ids, axis=1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * m.routed_scaling_factor, ids


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
  """A DeepSeek-V3 HF `config.json` dict -> ModelConfig. A missing key or an unsupported
  value raises ValueError naming it."""
  missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
  experts = raw.get("n_routed_experts") or raw.get("num_local_experts") or 0
  if experts:
    missing += [k for k in MOE_KEYS if raw.get(k) is None]
  if missing:
    raise ValueError(f"DeepseekV3ForCausalLM config is missing {missing}")
  unsupported = {k: raw[k] for k, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                         ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))
                 if k in raw and raw[k] != ok}
  if unsupported:
    raise ValueError(f"unsupported DeepseekV3ForCausalLM config values {unsupported}")
  heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
  layers = raw["num_hidden_layers"]
  first_dense = int(raw.get("first_k_dense_replace") or 0) if experts else layers
  n_group = int(raw.get("n_group") or 1) if experts else 1
  if experts and experts % n_group:
    raise ValueError(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
  moe_inter = int(raw.get("moe_intermediate_size") or 0) if experts else 0
  mla = MlaConfig(
      q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw["kv_lora_rank"],
      qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
      v_head_dim=raw["v_head_dim"], rope_interleave=bool(raw.get("rope_interleave", True)),
      first_k_dense_replace=min(first_dense, layers),
      dense_intermediate_size=raw["intermediate_size"] if first_dense else 0,
      shared_intermediate_size=moe_inter * int(raw.get("n_shared_experts") or 0),
      n_group=n_group, topk_group=int(raw.get("topk_group") or 1) if experts else 1,
      routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0))
  rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
  theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
  max_pos = raw.get("max_position_embeddings", 4096)
  rope_scaling = parse_rope(rope, max_pos)
  qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
  return ModelConfig(
      model_type="deepseek_v3", family=FAMILY, vocab_size=raw["vocab_size"],
      hidden_size=hidden, intermediate_size=mla.mlp_width, num_layers=layers,
      num_heads=heads, num_kv_heads=1, head_dim=mla.latent_dim,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
      rope_scaling=rope_scaling, max_position_embeddings=max_pos,
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
      attn_scale=softmax_scale(qk, rope, rope_scaling),
      num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
      moe_intermediate_size=moe_inter, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=hf_eos_token_ids(raw), mla=mla)


def parse_rope(rope: dict[str, Any], max_position_embeddings: int) -> YarnScaling | None:
  """Plain RoPE (None) or YaRN, resolved as for GPT-OSS (gpt_oss.parse_rope)."""
  kind = rope.get("rope_type") or rope.get("type") or "default"
  if kind not in gpt_oss.ROPE_TYPES:
    raise ValueError(f"unsupported rope type {kind!r} for DeepseekV3ForCausalLM (supported: "
                     f"{gpt_oss.ROPE_TYPES})")
  return gpt_oss.parse_rope(rope, max_position_embeddings)


def softmax_scale(qk_head_dim: int, rope: dict[str, Any], yarn: YarnScaling | None) -> float:
  """`qk_head_dim ** -0.5`, times mscale(factor, mscale_all_dim) ** 2 under YaRN
  (transformers' `yarn_apply_mscale`)."""
  scale = qk_head_dim ** -0.5
  mscale_all = rope.get("mscale_all_dim") or 0
  if yarn is not None and mscale_all:
    mscale = gpt_oss._yarn_mscale(yarn.factor, float(mscale_all))
    scale *= mscale * mscale
  return scale


# HF names (after "model.layers.{i}.") -> (params key, transpose).
HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.q_a_proj.weight": ("wq_a", True),
    "self_attn.q_a_layernorm.weight": ("q_a_norm", False),
    "self_attn.q_b_proj.weight": ("wq_b", True),
    "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", True),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", False),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate.weight": ("router", True),
    "mlp.gate.e_score_correction_bias": ("router_bias", False),
}
_MLP_RE = re.compile(r"mlp\.(?:shared_experts\.)?(gate|up|down)_proj\.weight")
_EXPERT_RE = re.compile(r"mlp\.experts\.(?:(\d+)\.(gate|up|down)_proj\.weight|"
                        r"(gate_up_proj|down_proj))")
_MLP_KEYS = {"gate": "w_gate", "up": "w_up", "down": "w_down"}


def put_tensor(builder: Any, cfg: ModelConfig, layer: int, rest: str, read) -> None:
  """Routes one layer tensor of a DeepSeek checkpoint (`rest`: its name after
  "model.layers.{layer}.") into `builder` (checkpoints.layout.ParamsBuilder). Layers past
  num_hidden_layers (the multi-token-prediction layer) are skipped, as transformers
  skips them; a dense layer's first tensor also fills its router and experts with zeros."""
  if layer >= cfg.num_layers:
    return
  m = cfg.mla
  if layer < m.first_k_dense_replace and cfg.is_moe and rest == "input_layernorm.weight":
    for key in ("router", "router_bias", "we_gate", "we_up", "we_down"):
      shape = builder.params["layers"][key].shape[1:]
      builder.put(key, np.zeros(shape, builder.dtype), layer, source=f"(dense layer {layer})")
  if rest in HF_LAYER_NAMES:
    key, transpose = HF_LAYER_NAMES[rest]
    v = read()
    builder.put(key, v.T if transpose else v, layer, source=rest)
  elif rest == "self_attn.kv_b_proj.weight":  # [N*(dn+dv), R] -> w_uk [R, N*dn], w_uv [R, N*dv]
    v = read().reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    builder.put("w_uk", v[:, :m.qk_nope_head_dim].reshape(-1, m.kv_lora_rank).T, layer,
                source=rest)
    builder.put("w_uv", v[:, m.qk_nope_head_dim:].reshape(-1, m.kv_lora_rank).T, layer,
                source=rest)
  elif mm := _MLP_RE.fullmatch(rest):
    v = read().T  # [in, out]
    axis = 0 if mm.group(1) == "down" else 1
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, m.mlp_width - v.shape[axis])
    builder.put(_MLP_KEYS[mm.group(1)], np.pad(v, pad), layer, source=rest)
  elif em := _EXPERT_RE.fullmatch(rest):
    _put_experts(builder, em, read(), layer, rest)
  else:
    raise ValueError(f"unsupported tensor {rest!r} in layer {layer} of a deepseek_v3 checkpoint")


_KEPT_QUANTIZED_RE = re.compile(r"model\.layers\.(\d+)\.(?:self_attn\.(?:o_proj|q_proj)|"
                                r"mlp\.experts\.\d+\.(?:gate|up|down)_proj)")


def dequantized_at_load(module: str, cfg: ModelConfig) -> bool:
  """Whether a pre-quantized (FP8) linear `module` of a DeepSeek checkpoint is loaded as
  float: everything but the routed experts, `o_proj` and a direct `q_proj`, whose
  params keep the checkpoint's layout (the others are split or zero-padded at load);
  also the layers past num_hidden_layers, which `put_tensor` skips."""
  m = _KEPT_QUANTIZED_RE.fullmatch(module)
  return m is None or int(m.group(1)) >= cfg.num_layers


def _put_experts(builder: Any, em: re.Match, v: np.ndarray, layer: int, name: str) -> None:
  """Routed experts: one per tensor ([out, in]) or fused ([E, 2M, D] gate rows first;
  [E, D, M])."""
  if em.group(1) is not None:
    builder.put("we_" + em.group(2), v.T, layer, int(em.group(1)), source=name)
  elif em.group(3) == "down_proj":
    builder.put("we_down", v.transpose(0, 2, 1), layer, source=name)
  else:
    gate, up = np.split(v, 2, axis=1)
    builder.put("we_gate", gate.transpose(0, 2, 1), layer, source=name)
    builder.put("we_up", up.transpose(0, 2, 1), layer, source=name)
