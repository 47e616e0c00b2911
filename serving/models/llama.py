"""The Llama-family transformer as pure JAX functions over a params pytree.

Covers Llama 2/3/3.1 (llama3 RoPE scaling), Mistral (sliding window), Qwen2
(QKV bias), Qwen3 (q/k RMSNorm), SmolLM2 (tied embeddings) and the MoE
variants Mixtral / Qwen3-MoE; `ModelConfig` flags select the pieces. The
params layout is documented in docs/structure.md.

Dimension letters: T tokens, D model dim, N query heads, K kv heads,
G query heads per kv head, H head dim, F mlp dim, E experts, V vocab.

The layer stack is a `lax.scan` over stacked weights, or a Python loop over
per-layer weights (`unstack_layers`; faster on XLA:CPU, slower to compile).
Attention is a callback
`attend(layer, q[T,N,H], k[T,K,H], v[T,K,H], kv) -> (out[T,N,H], kv)` that
owns the KV cache write and the paged read, so the same forward serves
prefill chunks and decode batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.model_config import ModelConfig

Params = dict[str, Any]
AttendFn = Callable[..., tuple[jax.Array, Any]]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies [H/2] (float32), with llama3 scaling if configured."""
  h = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
  inv = inv.astype(np.float32)
  rs = cfg.rope_scaling
  if rs is None:
    return inv
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
      rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x [T, heads, H]; positions [T] int32."""
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, H]
  cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (w.astype(jnp.float32) * xf).astype(x.dtype)


def linear(x: jax.Array, w: Any) -> jax.Array:
  """x [..., In] @ w [In, Out], accumulating in float32.

  `w` is a plain array or a quantized weight object exposing `matmul(x)`.
  """
  if hasattr(w, "matmul"):
    return w.matmul(x)
  out = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
  return out.astype(x.dtype)


def _attention_block(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                     inv_freq: jax.Array, layer: jax.Array, kv: Any,
                     attend: AttendFn) -> tuple[jax.Array, Any]:
  """Pre-norm self-attention sub-block for one layer; returns (residual delta, kv)."""
  t = x.shape[0]
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  xn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
  q, kk, v = linear(xn, lp["wq"]), linear(xn, lp["wk"]), linear(xn, lp["wv"])
  if cfg.qkv_bias:
    q, kk, v = q + lp["bq"].astype(q.dtype), kk + lp["bk"].astype(q.dtype), v + lp["bv"].astype(
        q.dtype)
  # [T, N*H] -> [T, N, H]
  q, kk, v = q.reshape(t, n, h), kk.reshape(t, k, h), v.reshape(t, k, h)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    kk = rms_norm(kk, lp["k_norm"], cfg.rms_norm_eps)
  q, kk = apply_rope(q, positions, inv_freq), apply_rope(kk, positions, inv_freq)
  out, kv = attend(layer, q, kk, v, kv)
  # [T, N, H] -> [T, N*H]
  return linear(out.reshape(t, n * h).astype(x.dtype), lp["wo"]), kv


def dense_mlp(lp: Params, x: jax.Array) -> jax.Array:
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  g = linear(x, lp["w_gate"])
  u = linear(x, lp["w_up"])
  return linear(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, lp["w_down"])


def moe_route(cfg: ModelConfig, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Top-k routing. router_logits [T, E] -> (weights [T, k] f32, expert ids [T, k])."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids


def moe_mlp(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
  """Mixture of SwiGLU experts with grouped (ragged) matmuls.

  Token-expert pairs are sorted by expert and each expert multiplies only its
  own rows (`lax.ragged_dot`), so the cost is k/E of a dense loop over experts.
  """
  t, d = x.shape
  topk = cfg.num_experts_per_tok
  weights, ids = moe_route(cfg, linear(x, lp["router"]))
  flat_ids = ids.reshape(-1)  # [T*k]
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // topk  # token index of each sorted pair
  xs = x[token_of]  # [T*k, D]
  group_sizes = jnp.bincount(flat_ids, length=cfg.num_experts).astype(jnp.int32)

  def grouped(a, w):
    return jax.lax.ragged_dot(a.astype(w.dtype), w, group_sizes,
                              preferred_element_type=jnp.float32)

  g = grouped(xs, lp["we_gate"])
  u = grouped(xs, lp["we_up"])
  hdn = (jax.nn.silu(g) * u).astype(x.dtype)
  ys = grouped(hdn, lp["we_down"])  # [T*k, D] f32
  pair_w = weights.reshape(-1)[order]
  out = jnp.zeros((t, d), jnp.float32).at[token_of].add(ys * pair_w[:, None])
  return out.astype(x.dtype)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            kv: Any, attend: AttendFn, *, act_dtype=jnp.float32) -> tuple[jax.Array, Any]:
  """Runs the layer stack. tokens/positions [T] -> (final-normed hidden [T, D], kv)."""
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  x = params["embed"][tokens].astype(act_dtype)  # [T, D]
  mlp = functools.partial(moe_mlp, cfg) if cfg.is_moe else dense_mlp

  def layer_fn(carry, xs):
    h, kv = carry
    lp, layer = xs
    delta, kv = _attention_block(cfg, lp, h, positions, inv_freq, layer, kv, attend)
    h = h + delta
    h = h + mlp(lp, rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps))
    return (h, kv), None

  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    # Unrolled over per-layer arrays: fastest on XLA:CPU (no per-layer weight copies).
    for i, lp in enumerate(layers):
      (x, kv), _ = layer_fn((x, kv), (lp, jnp.int32(i)))
  else:
    # One scanned layer over stacked [L, ...] weights: fast to compile.
    ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv), _ = jax.lax.scan(layer_fn, (x, kv), (layers, ids))
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv


def unstack_layers(params: Params) -> Params:
  """Stacked `layers` {name: [L, ...]} -> a list of per-layer dicts (unrolled forward)."""
  layers = params["layers"]
  n = len(next(iter(layers.values())))
  return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
  """hidden [B, D] -> logits [B, V] in float32."""
  if cfg.tie_word_embeddings or "lm_head" not in params:
    emb = params["embed"]
    return jnp.einsum("bd,vd->bv", hidden.astype(emb.dtype), emb,
                      preferred_element_type=jnp.float32)
  return linear(hidden, params["lm_head"]).astype(jnp.float32)
