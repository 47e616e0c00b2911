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
prefill chunks and decode batches. MoE experts likewise run through a
callback `experts(x, weights, ids, (we_gate, we_up, we_down)) -> [T, D] f32`
(default `moe_experts`, every expert here); the runner passes the
expert-parallel one from `sharding`. This module knows no mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models.lora import LoraBatch, apply_lora
from serving.models.model_config import ModelConfig

Params = dict[str, Any]
# A layer's LoRA: (its {module: (a, b)} slots, each row's slot, method) or None.
LayerLora = tuple[dict, jax.Array, str] | None
AttendFn = Callable[..., tuple[jax.Array, Any]]
ExpertsFn = Callable[..., jax.Array]


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


def project(x: jax.Array, lp: Params, name: str, lora: LayerLora) -> jax.Array:
  """The layer's linear module `name`, plus its LoRA update when adapters are active."""
  y = linear(x, lp[name])
  if lora is None:
    return y
  weights, rows, method = lora
  return apply_lora(y, x, weights, rows, name, method)


def _attention_block(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                     inv_freq: jax.Array, layer: jax.Array, kv: Any,
                     attend: AttendFn, lora: LayerLora = None) -> tuple[jax.Array, Any]:
  """Pre-norm self-attention sub-block for one layer; returns (residual delta, kv)."""
  t = x.shape[0]
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  xn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
  q, kk, v = (project(xn, lp, name, lora) for name in ("wq", "wk", "wv"))
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
  return project(out.reshape(t, n * h).astype(x.dtype), lp, "wo", lora), kv


def dense_mlp(lp: Params, x: jax.Array, lora: LayerLora = None) -> jax.Array:
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  g = project(x, lp, "w_gate", lora)
  u = project(x, lp, "w_up", lora)
  return project(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, lp, "w_down", lora)


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


def moe_mlp(cfg: ModelConfig, lp: Params, x: jax.Array, experts_fn: ExpertsFn | None = None
            ) -> jax.Array:
  """Mixture of SwiGLU experts: route, then `experts_fn` (default `moe_experts`).

  `moe_experts` sorts token-expert pairs by expert and multiplies each expert's
  rows only (`lax.ragged_dot`): a grouped matmul where the backend has one.
  XLA:CPU expands it into a masked dot over all experts (k times the FLOPs of
  a dense all-expert MLP, same weight traffic; see docs/sharding.md). Under a
  mesh the runner passes `sharding.expert_parallel(cfg)`, which runs it as a
  `shard_map` over the devices' experts.
  """
  weights, ids = moe_route(cfg, linear(x, lp["router"]))
  experts = (lp["we_gate"], lp["we_up"], lp["we_down"])
  if experts_fn is not None:
    return experts_fn(x, weights, ids, experts)
  return moe_experts(x, weights, ids, *experts).astype(x.dtype)


def moe_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, we_gate: jax.Array,
                we_up: jax.Array, we_down: jax.Array, first_expert: jax.Array | int = 0
                ) -> jax.Array:
  """Experts [first, first + E_l) of one device -> their weighted output [T, D] f32.

  x [T, D]; weights, ids [T, k]; we_gate / we_up [E_l, D, M_l], we_down
  [E_l, M_l, D] (arrays, or quantized weights of those logical shapes, which
  are dequantized inside the step before the grouped matmul). Pairs routed
  to other experts sort last, past every group, and get weight 0; with a
  column slice M_l < M the output is a partial sum.
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
  hdn = (jax.nn.silu(g) * u).astype(x.dtype)
  ys = grouped(hdn, we_down)  # [T*k, D] f32
  # Rows past the groups (other devices' pairs) are masked, not scaled: never read.
  mine = (local[order] < e_local)[:, None]
  ys = jnp.where(mine, ys * weights.reshape(-1)[order][:, None], 0.0)
  return jnp.zeros((t, d), jnp.float32).at[token_of].add(ys)


def decoder_layer(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array,
                  inv_freq: jax.Array, layer: jax.Array, kv: Any, attend: AttendFn,
                  experts_fn: ExpertsFn | None = None, lora: LayerLora = None
                  ) -> tuple[jax.Array, Any]:
  """One pre-norm layer (attention, then dense or MoE MLP): h [T, D] -> (h, kv)."""
  delta, kv = _attention_block(cfg, lp, h, positions, inv_freq, layer, kv, attend, lora)
  h = h + delta
  hn = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
  mlp = moe_mlp(cfg, lp, hn, experts_fn) if cfg.is_moe else dense_mlp(lp, hn, lora)
  return h + mlp, kv


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            kv: Any, attend: AttendFn, *, act_dtype=jnp.float32,
            experts_fn: ExpertsFn | None = None,
            lora: LoraBatch | None = None) -> tuple[jax.Array, Any]:
  """Runs the layer stack. tokens/positions [T] -> (final-normed hidden [T, D], kv).

  `lora` (serving/models/lora.py): resident adapters, laid out like `layers`,
  and each token row's slot.
  """
  x = embed_tokens(params["embed"], tokens).astype(act_dtype)  # [T, D]
  x, kv = run_layers(params["layers"], cfg, x, positions, kv, attend, experts_fn=experts_fn,
                     lora=lora)
  return final_norm(params, cfg, x), kv


def run_layers(layers: Any, cfg: ModelConfig, x: jax.Array, positions: jax.Array, kv: Any,
               attend: AttendFn, *, experts_fn: ExpertsFn | None = None,
               lora: LoraBatch | None = None) -> tuple[jax.Array, Any]:
  """The decoder layers `layers` over h [T, D] -> (h, kv).

  `layers`: a list of per-layer dicts (unrolled) or one dict of stacked
  `[L', ...]` weights (scanned); either way the attention callback sees layer
  ids counted from 0 within `layers` (a pipeline stage passes its own layers
  and its own slice of the KV cache).
  """
  inv_freq = jnp.asarray(rope_inv_freq(cfg))

  def layer_fn(carry, xs):
    h, kv = carry
    lp, layer, lora_lp = xs
    layer_lora = None if lora is None else (lora_lp, lora.rows, lora.method)
    return decoder_layer(cfg, lp, h, positions, inv_freq, layer, kv, attend, experts_fn,
                         layer_lora), None

  if isinstance(layers, (list, tuple)):
    # Unrolled over per-layer arrays: fastest on XLA:CPU (no per-layer weight copies).
    for i, lp in enumerate(layers):
      lora_lp = None if lora is None else lora.weights[i]
      (x, kv), _ = layer_fn((x, kv), (lp, jnp.int32(i), lora_lp))
    return x, kv
  # One scanned layer over stacked [L', ...] weights: fast to compile.
  ids = jnp.arange(jax.tree.leaves(layers)[0].shape[0], dtype=jnp.int32)
  lora_layers = None if lora is None else lora.weights
  (x, kv), _ = jax.lax.scan(layer_fn, (x, kv), (layers, ids, lora_layers))
  return x, kv


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def unstack_layers(params: Params) -> Params:
  """Stacked `layers` {name: [L, ...]} -> a list of per-layer dicts (unrolled forward)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):  # already per layer (e.g. GGUF layers of mixed types)
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(n)]}


def embed_tokens(embed: Any, tokens: jax.Array) -> jax.Array:
  """Embedding rows [T, D]; a quantized tied embedding dequantizes only these rows."""
  return embed.lookup(tokens) if hasattr(embed, "lookup") else embed[tokens]


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
  """hidden [B, D] -> logits [B, V] in float32."""
  if cfg.tie_word_embeddings or "lm_head" not in params:
    emb = params["embed"]
    if hasattr(emb, "matmul"):  # quantized tied embedding: stored as the head [V, D]
      return emb.matmul(hidden).astype(jnp.float32)
    return dot_f32_accumulate("bd,vd->bv", hidden, emb)
  return linear(hidden, params["lm_head"]).astype(jnp.float32)
