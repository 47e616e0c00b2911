"""Gated DeltaNet math (Qwen3-Next / Qwen3.5 linear attention), pure jnp.

A linear-attention layer keeps, per sequence, a conv state (the last Kc-1
inputs of its short causal depthwise convolution) and a recurrent state
S [NV, dk, dv] per value head, updated per token by the gated delta rule:

  S <- exp(g) * S;  S <- S + k (beta * (v - k^T S))^T;  out = q^T S

Prefill runs the chunked (WY) form over blocks of `chunk` rows; decode the
recurrent step. Prefill rows are packed: C chunks (each one sequence's
consecutive tokens, `cu` [C+1] row offsets, as the paged-attention prefill
packs them), each starting from its own initial state. Blocks never span two
chunks: chunk c covers ceil(len_c / chunk) blocks, laid out back to back in
NB = T // chunk + C blocks (static), padding rows and blocks inert (g = 0,
beta = 0 leave a state unchanged).

Letters: T packed rows, C chunks, B decode rows, NB blocks, Q rows per block,
NV value heads, dk / dv key / value head dims, Kc conv kernel, F conv channels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis (FLA's l2norm), float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def row_chunks(cu: jax.Array, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per packed row: (chunk id [T], offset in its chunk [T], real row [T] bool)."""
  rows = jnp.arange(t, dtype=jnp.int32)
  chunk = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0, cu.shape[0] - 2)
  return chunk, rows - cu[chunk], rows < cu[-1]


def causal_conv_packed(x: jax.Array, w: jax.Array, init: jax.Array,
                       cu: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv of packed chunks, each continuing its own state, then silu.

  x [T, F]; w [Kc, F] (tap Kc-1 multiplies the current row); init [C, Kc-1, F] the
  inputs before each chunk (oldest first). -> (out [T, F], the chunks' new states
  [C, Kc-1, F]: the last Kc-1 inputs of each chunk, older state where it is short).
  """
  t, kc = x.shape[0], w.shape[0]
  chunk, off, _ = row_chunks(cu, t)
  lens = cu[1:] - cu[:-1]

  def virtual(c, o):  # input at offset o of chunk c: a row, or the state for o < 0
    row = jnp.clip(cu[c] + o, 0, t - 1)
    old = init[c, jnp.clip(kc - 1 + o, 0, kc - 2)]
    return jnp.where((o >= 0)[..., None], x[row], old)

  acc = jnp.zeros(x.shape, jnp.float32)
  for i in range(kc):
    acc = acc + virtual(chunk, off - (kc - 1 - i)).astype(jnp.float32) * w[i].astype(jnp.float32)
  cs = jnp.arange(init.shape[0], dtype=jnp.int32)
  state = jnp.stack([virtual(cs, lens - (kc - 1) + m) for m in range(kc - 1)], axis=1)
  return jax.nn.silu(acc).astype(x.dtype), state.astype(init.dtype)


def conv_step(x: jax.Array, w: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One decode token per row: x [B, F], state [B, Kc-1, F] -> (silu(conv) [B, F], state)."""
  window = jnp.concatenate([state, x[:, None].astype(state.dtype)], axis=1)  # [B, Kc, F]
  out = jnp.sum(window.astype(jnp.float32) * w[None].astype(jnp.float32), axis=1)
  return jax.nn.silu(out).astype(x.dtype), window[:, 1:]


def expand_heads(x: jax.Array, nv: int) -> jax.Array:
  """[..., NK, dk] -> [..., NV, dk]: value head h reads key head h // (NV / NK)."""
  return jnp.repeat(x, nv // x.shape[-2], axis=-2)


def recurrent_step(q, k, v, g, beta, state):
  """One token per row. q, k [B, NV, dk] (l2-normed, q scaled); v [B, NV, dv];
  g, beta [B, NV]; state [B, NV, dk, dv] f32 -> (out [B, NV, dv], state)."""
  s = state * jnp.exp(g)[..., None, None]
  mem = jnp.einsum("bhk,bhkv->bhv", k, s)
  delta = (v - mem) * beta[..., None]
  s = s + k[..., :, None] * delta[..., None, :]
  return jnp.einsum("bhk,bhkv->bhv", q, s), s


def _block(q, k, v, g, beta, s):
  """The chunked rule over one block. q, k [Q, NV, dk]; v [Q, NV, dv]; g, beta [Q, NV];
  s [NV, dk, dv] -> (out [Q, NV, dv], state after the block)."""
  qh, kh, vh = (jnp.swapaxes(a, 0, 1) for a in (q, k, v))  # [NV, Q, .]
  gh, bh = g.T, beta.T  # [NV, Q]
  n = qh.shape[1]
  gc = jnp.cumsum(gh, axis=-1)  # [NV, Q]
  lower = jnp.tril(jnp.ones((n, n), bool))
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, gc[:, :, None] - gc[:, None, :], 0.0)), 0.0)
  kb, vb = kh * bh[..., None], vh * bh[..., None]
  strict = jnp.tril(jnp.ones((n, n), bool), -1)
  a = jnp.where(strict, jnp.einsum("hik,hjk->hij", kb, kh) * decay, 0.0)
  eye = jnp.eye(n, dtype=a.dtype)
  solve = jax.vmap(lambda m, b: jax.scipy.linalg.solve_triangular(
      m, b, lower=True, unit_diagonal=True))
  new_v = solve(a + eye, vb)  # [NV, Q, dv]
  k_cum = solve(a + eye, kb * jnp.exp(gc)[..., None])  # [NV, Q, dk]
  intra = jnp.einsum("hik,hjk->hij", qh, kh) * decay
  v_new = new_v - jnp.einsum("hik,hkv->hiv", k_cum, s)
  out = jnp.einsum("hik,hkv->hiv", qh * jnp.exp(gc)[..., None], s) + intra @ v_new
  last = gc[:, -1:]  # [NV, 1]
  kd = kh * jnp.exp(last - gc)[..., None]
  s = s * jnp.exp(last)[..., None] + jnp.einsum("hik,hiv->hkv", kd, v_new)
  return jnp.swapaxes(out, 0, 1), s


def chunked_rule_packed(q, k, v, g, beta, init, cu, chunk: int):
  """The gated delta rule over packed chunks, each from its own initial state.

  q, k [T, NV, dk] (l2-normed, q scaled); v [T, NV, dv]; g, beta [T, NV] f32;
  init [C, NV, dk, dv] f32; cu [C+1]. -> (out [T, NV, dv] f32, final states [C, ...]).
  """
  t, n_chunks = q.shape[0], init.shape[0]
  nb = t // chunk + n_chunks
  row_chunk, off, real = row_chunks(cu, t)
  lens = cu[1:] - cu[:-1]
  blk_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum(-(-lens // chunk)).astype(jnp.int32)])
  blocks = jnp.arange(nb, dtype=jnp.int32)
  bchunk = jnp.clip(jnp.searchsorted(blk_cu, blocks, side="right") - 1, 0, n_chunks - 1)
  bstart = cu[bchunk] + (blocks - blk_cu[bchunk]) * chunk  # [NB]
  rows = bstart[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [NB, Q]
  live = (rows < cu[bchunk + 1][:, None]) & (blocks < blk_cu[-1])[:, None]
  idx = jnp.clip(rows, 0, t - 1)

  def gather(a):
    return jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a[idx], 0).astype(
        jnp.float32)

  qb, kb, vb, gb, bb = (gather(a) for a in (q, k, v, g, beta))
  first = blocks == blk_cu[bchunk]

  def body(s, xs):
    qi, ki, vi, gi, bi, c, is_first = xs
    s = jnp.where(is_first, init[c], s)
    out, s = _block(qi, ki, vi, gi, bi, s)
    return s, (out, s)

  _, (outs, states) = jax.lax.scan(body, jnp.zeros_like(init[0]),
                                   (qb, kb, vb, gb, bb, bchunk, first))
  row_blk = jnp.clip(blk_cu[row_chunk] + off // chunk, 0, nb - 1)
  out = jnp.where(real[:, None, None], outs[row_blk, off % chunk], 0.0)
  last = jnp.clip(blk_cu[1:] - 1, 0, nb - 1)
  final = jnp.where((lens > 0)[:, None, None, None], states[last], init)
  return out, final


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StateCarry:
  """What a linear-attention model's layers thread through a step in place of the KV
  cache alone (the runner builds it, serving/runner/state_cache.py): the cache, every
  slot's states and the step's rows.

  States are per state slot S (the runner's decode slots, the last one the dummy that
  padding writes) and per linear layer (block G, linear layer J within it). A prefill
  step has `cu` (its packed chunks) and `reset` (a chunk that starts its sequence
  begins from zero states); a decode step has neither (one row per slot).
  """

  kv: Any  # the KV cache of the full-attention layers (the attention callback's)
  conv: jax.Array  # [S, G, J, Kc-1, F] each slot's last conv inputs
  rec: jax.Array  # [S, G, J, NV, dk, dv] f32 each slot's recurrent state
  slots: jax.Array  # [C] each chunk's slot (prefill) / [B] each row's (decode)
  cu: jax.Array | None = None  # [C+1] packed chunk row offsets (prefill)
  reset: jax.Array | None = None  # [C] bool: the chunk is its sequence's first
  chunk: int = dataclasses.field(default=64, metadata=dict(static=True))


def mix(carry: StateCarry, layer, j: int, qkv: jax.Array, conv_w: jax.Array, a: jax.Array,
        b: jax.Array, a_log: jax.Array, dt_bias: jax.Array, dk: int
        ) -> tuple[jax.Array, StateCarry]:
  """One linear-attention layer's token mixing from its slots' states, writing them back.

  qkv [T, NK, 2*dk + r*dv] (per key head: q, k, then its r value heads' v), before the
  conv; conv_w [Kc, NK * (2*dk + r*dv)]; a, b [T, NV] the decay / beta projections;
  a_log, dt_bias [NV]. -> (core [T, NV, dv] f32, carry).
  """
  t, nk, width = qkv.shape
  nv = a.shape[-1]
  dv = (width - 2 * dk) * nk // nv
  conv0 = carry.conv[carry.slots, layer, j]  # [C|B, Kc-1, F]
  rec0 = carry.rec[carry.slots, layer, j]  # [C|B, NV, dk, dv]
  x = qkv.reshape(t, nk * width)
  if carry.cu is None:
    y, conv1 = conv_step(x, conv_w, conv0)
  else:
    keep = ~carry.reset
    conv0 = jnp.where(keep[:, None, None], conv0, 0)
    rec0 = jnp.where(keep[:, None, None, None], rec0, 0.0)
    y, conv1 = causal_conv_packed(x, conv_w, conv0, carry.cu)
  y = y.reshape(t, nk, width)
  q = expand_heads(l2norm(y[..., :dk]), nv) * dk ** -0.5
  k = expand_heads(l2norm(y[..., dk:2 * dk]), nv)
  v = y[..., 2 * dk:].reshape(t, nv, dv).astype(jnp.float32)
  g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
      a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
  beta = jax.nn.sigmoid(b.astype(jnp.float32))
  if carry.cu is None:
    core, rec1 = recurrent_step(q, k, v, g, beta, rec0)
  else:
    core, rec1 = chunked_rule_packed(q, k, v, g, beta, rec0, carry.cu, carry.chunk)
  conv = carry.conv.at[carry.slots, layer, j].set(conv1.astype(carry.conv.dtype))
  rec = carry.rec.at[carry.slots, layer, j].set(rec1)
  return core, dataclasses.replace(carry, conv=conv, rec=rec)
