"""Layers shared by the model families: norms, rotary embeddings, linear maps
(float or quantized, with LoRA), MLP kinds, mixture of experts, embedding and head.

Pure functions over arrays (or quantized weight leaves, serving/models/quantized.py);
the family modules (serving/models/<family>.py) compose them. Dimension letters:
T tokens, D model dim, N query heads, K kv heads, H head dim, F mlp dim,
E experts, V vocab.

MoE experts run through a callback
`experts(x, weights, ids, (we_gate, we_up, we_down[, be_gate, be_up])) -> [T, D]`
(default `moe_experts`, every expert here; the gated activation is the
config's `moe_activation`); the runner passes the expert-parallel one from
`sharding`. This module knows no mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models.lora import apply_lora
from serving.models.model_config import (
  LinearRopeScaling,
  LongRopeScaling,
  ModelConfig,
  YarnScaling,
)

Params = dict[str, Any]
# A layer's LoRA: (its {module: (a, b)} slots, each row's slot, method) or None.
LayerLora = tuple[dict, jax.Array, str] | None
AttendFn = Callable[..., tuple[jax.Array, Any]]
ExpertsFn = Callable[..., jax.Array]


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None,
                  scaled: bool = True) -> np.ndarray:
  """Inverse RoPE frequencies [rotary_dim / 2] (float32) for base `theta` (default
  cfg.rope_theta), scaled as cfg configures when `scaled` (Gemma 3's sliding layers
  use their own base unscaled): llama3, linear, YaRN, or the LongRoPE factor set in
  use (`rope_attention_scale` is the matching cos / sin factor)."""
  h = cfg.rotary_dim
  theta = cfg.rope_theta if theta is None else theta
  inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
  inv = inv.astype(np.float32)
  rs = cfg.rope_scaling if scaled else None
  if rs is None:
    return inv
  if isinstance(rs, LongRopeScaling):
    return (inv / np.asarray(rs.factors, np.float32)).astype(np.float32)
  if isinstance(rs, YarnScaling):
    return yarn_inv_freq(h, theta, rs)
  if isinstance(rs, LinearRopeScaling):
    return (inv / np.float32(rs.factor)).astype(np.float32)
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
      rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_inv_freq(head_dim: int, theta: float, yarn: YarnScaling) -> np.ndarray:
  """YaRN inverse frequencies [H/2] (float32), as transformers' `_compute_yarn_parameters`:
  interpolated (divided by `factor`) below the correction range, extrapolated (plain)
  above it, a linear ramp between. The cos / sin factor is `yarn.attention_factor`."""
  dim = head_dim
  pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  extrapolation = (1.0 / pos_freqs).astype(np.float32)
  interpolation = (1.0 / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)

  def correction_dim(rotations: float) -> float:
    return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(theta))

  low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation_factor = (1 - ramp).astype(np.float32)
  inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
  return inv.astype(np.float32)


def rope_attention_scale(cfg: ModelConfig) -> float:
  """The factor on RoPE's cos and sin (LongRoPE's attention factor; else 1)."""
  rs = cfg.rope_scaling
  return rs.attention_factor if isinstance(rs, (LongRopeScaling, YarnScaling)) else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float = 1.0) -> jax.Array:
  """Rotate-half RoPE on the first R = 2 * len(inv_freq) dims of each head (the rest
  pass through: partial rotary), cos and sin times `scale`. x [T, heads, H];
  positions [T] int32."""
  rot = 2 * inv_freq.shape[0]
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, R]
  cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  xf = x.astype(jnp.float32)
  xr = xf[..., :rot] if rot < x.shape[-1] else xf
  half = rot // 2
  out = xr * cos + jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1) * sin
  if rot < x.shape[-1]:
    out = jnp.concatenate([out, xf[..., rot:]], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (w.astype(jnp.float32) * xf).astype(x.dtype)


def rms_norm_plus_one(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMSNorm scaled by `(1 + w)`, all in float32, cast back to x's dtype (Gemma's
  zero-centred norm weights)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def dot_f32_accumulate(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`einsum(spec, x, w)` with x cast to w's dtype, accumulated in float32.

  `spec` contracts x's last axis; x has any leading axes. XLA:CPU sends a dot
  with a single row and bfloat16 (or integer) operands to a naive loop, about
  ten times slower than the same dot with two rows (SmolLM2's 30 layers of
  matmuls: 185 ms at one row, 16 ms at two; docs/performance.md), so on CPU a
  single row is padded to two. float32 single-row dots take XLA's fast
  matrix-vector path and are left alone.
  """
  x = x.astype(w.dtype)
  lead = x.shape[:-1]
  if math.prod(lead) == 1 and w.dtype != jnp.float32 and jax.default_backend() == "cpu":
    two = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
    out = jnp.einsum(spec, two, w, preferred_element_type=jnp.float32)
    return out[:1].reshape(*lead, out.shape[-1])
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: Any) -> jax.Array:
  """x [..., In] @ w [In, Out], accumulating in float32.

  `w` is a plain array or a quantized weight object exposing `matmul(x)`.
  """
  if hasattr(w, "matmul"):
    return w.matmul(x)
  return dot_f32_accumulate("...i,io->...o", x, w).astype(x.dtype)


def project(x: jax.Array, w: Any, name: str, lora: LayerLora) -> jax.Array:
  """x @ w for the layer's linear module `name`, plus its LoRA update when adapters
  are active."""
  y = linear(x, w)
  if lora is None:
    return y
  weights, rows, method = lora
  return apply_lora(y, x, weights, rows, name, method)


def qkv_heads(cfg: ModelConfig, xn: jax.Array, wq: Any, wk: Any, wv: Any,
              lora: LayerLora = None, biases: tuple[Any, Any, Any] | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The attention inputs of normed x [T, D]: q [T, N, H], k and v [T, K, H]
  (plus the projections' biases when given)."""
  t = xn.shape[0]
  q, k, v = (project(xn, w, name, lora) for w, name in ((wq, "wq"), (wk, "wk"), (wv, "wv")))
  if biases is not None:
    q, k, v = (y + b.astype(y.dtype) for y, b in zip((q, k, v), biases, strict=True))
  # [T, N*H] -> [T, N, H]
  n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return q.reshape(t, n, h), k.reshape(t, kh, h), v.reshape(t, kh, h)


def attention_output(out: jax.Array, wo: Any, dtype, lora: LayerLora = None) -> jax.Array:
  """The output projection of the attention heads out [T, N, H] -> [T, D]."""
  t, n, h = out.shape
  return project(out.reshape(t, n * h).astype(dtype), wo, "wo", lora)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """The MLP activation `name` (HF `hidden_act` / `hidden_activation`)."""
  if name not in ACTIVATIONS:
    raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]


def gated_mlp(x: jax.Array, w_gate: Any, w_up: Any, w_down: Any, lora: LayerLora = None,
              act: str = "silu") -> jax.Array:
  """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with a gelu."""
  g = project(x, w_gate, "w_gate", lora)
  u = project(x, w_up, "w_up", lora)
  hdn = activation(act)(g.astype(jnp.float32)).astype(x.dtype) * u
  return project(hdn, w_down, "w_down", lora)


def moe_route(cfg: ModelConfig, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Top-k routing. router_logits [T, E] -> (weights [T, k] f32, expert ids [T, k]).

  Softmax over all experts, then the top k (Mixtral, Qwen3-MoE); with
  `norm_topk_prob` the k weights are renormalized to sum to one.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids


def moe_mlp(cfg: ModelConfig, router: Any, experts: tuple[Any, Any, Any], x: jax.Array,
            experts_fn: ExpertsFn | None = None) -> jax.Array:
  """Mixture of SwiGLU experts: route, then `experts_fn` (default `moe_experts`).

  `moe_experts` sorts token-expert pairs by expert and multiplies each expert's
  rows only (`lax.ragged_dot`): a grouped matmul where the backend has one.
  XLA:CPU expands it into a masked dot over all experts (k times the FLOPs of
  a dense all-expert MLP, same weight traffic; see docs/sharding.md). Under a
  mesh the runner passes `sharding.expert_parallel(cfg)`, which runs it as a
  `shard_map` over the devices' experts.
  """
  weights, ids = moe_route(cfg, linear(x, router))
  if experts_fn is not None:
    return experts_fn(x, weights, ids, experts)
  return moe_experts(x, weights, ids, *experts, activation=expert_activation(cfg)
                     ).astype(x.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
  """GPT-OSS's expert activation (float32): gate clamped above at `limit`, up to
  [-limit, limit], `(up + 1) * gate * sigmoid(alpha * gate)`."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(gate * alpha)


def expert_activation(cfg: ModelConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The experts' gated activation `(gate, up) -> hidden` (float32) of `cfg`."""
  if cfg.moe_activation == "clamped_swiglu":
    return functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
  return lambda gate, up: jax.nn.silu(gate) * up


def moe_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, we_gate: jax.Array,
                we_up: jax.Array, we_down: jax.Array, be_gate: jax.Array | None = None,
                be_up: jax.Array | None = None, *, first_expert: jax.Array | int = 0,
                activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None
                ) -> jax.Array:
  """Experts [first, first + E_l) of one device -> their weighted output [T, D] f32.

  x [T, D]; weights, ids [T, k]; we_gate / we_up [E_l, D, M_l], we_down
  [E_l, M_l, D] (arrays, or quantized weights of those logical shapes, which
  are dequantized inside the step before the grouped matmul); optional
  biases be_gate / be_up [E_l, M_l] (a down-projection bias is the caller's,
  added once after the partial sums); `activation(gate, up)` on float32
  (default silu(gate) * up). Pairs routed to other experts sort last, past
  every group, and get weight 0; with a column slice M_l < M the output is a
  partial sum.
  """
  t, d = x.shape
  topk, e_local = ids.shape[1], we_gate.shape[0]
  local = ids.reshape(-1) - first_expert  # [T*k]
  local = jnp.where((local >= 0) & (local < e_local), local, e_local)
  order = jnp.argsort(local, stable=True)
  token_of = order // topk  # token index of each sorted pair
  xs = x[token_of]  # [T*k, D]
  group_sizes = jnp.bincount(local, length=e_local).astype(jnp.int32)  # drops id e_local

  def grouped(a, w):
    if hasattr(w, "dense"):  # quantized experts: this device's experts, dequantized here
      w = w.dense(a)
    return jax.lax.ragged_dot(a.astype(w.dtype), w, group_sizes,
                              preferred_element_type=jnp.float32)

  g = grouped(xs, we_gate)
  u = grouped(xs, we_up)
  if be_gate is not None:
    expert_of = jnp.minimum(local[order], e_local - 1)  # each sorted pair's local expert
    g = g + be_gate.astype(jnp.float32)[expert_of]
    u = u + be_up.astype(jnp.float32)[expert_of]
  act = activation or (lambda gate, up: jax.nn.silu(gate) * up)
  hdn = act(g, u).astype(x.dtype)
  ys = grouped(hdn, we_down)  # [T*k, D] f32
  # Rows past the groups (other devices' pairs) are masked, not scaled: never read.
  mine = (local[order] < e_local)[:, None]
  ys = jnp.where(mine, ys * weights.reshape(-1)[order][:, None], 0.0)
  return jnp.zeros((t, d), jnp.float32).at[token_of].add(ys)


def embed_tokens(embed: Any, tokens: jax.Array) -> jax.Array:
  """Embedding rows [T, D]; a quantized tied embedding dequantizes only these rows."""
  return embed.lookup(tokens) if hasattr(embed, "lookup") else embed[tokens]


def tied_head_logits(embed: Any, hidden: jax.Array) -> jax.Array:
  """hidden [B, D] -> logits [B, V] f32 through the tied embedding [V, D]."""
  if hasattr(embed, "matmul"):  # quantized tied embedding: stored as the head [V, D]
    return embed.matmul(hidden).astype(jnp.float32)
  return dot_f32_accumulate("bd,vd->bv", hidden, embed)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap) (Gemma's logit soft-capping); x unchanged without a cap."""
  return x if cap is None else cap * jnp.tanh(x / cap)
