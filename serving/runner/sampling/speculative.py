"""`verify`: which proposed (draft) tokens a speculative step keeps, and the token after them.

A speculative row holds its latest token and up to S-1 drafts d_1..d_n
(n = `num_drafts`, the rest padding); the verify forward scores all S
positions at once, so `logits[:, j]` is the target distribution of the output
token at position j given d_1..d_j. Acceptance runs left to right:

  * greedy rows keep d_{j+1} while it equals the argmax at position j;
  * random rows keep d_{j+1} with probability p_j(d_{j+1}), where p_j is the
    distribution `sample` would draw from at that position (penalties,
    temperature, top-k, top-p, min-p all applied);
  * at the first rejected position a the row draws its next token from p_a
    with d_{a+1} removed and renormalised; when every draft was kept it draws
    from p_n (the "bonus" token).

The drafts of every proposer we run (n-gram, suffix, a draft model's argmax)
are deterministic, i.e. a one-hot proposal q = δ(d). Rejection sampling with
a one-hot q is exact: a token x is emitted at a position with probability
p(d) [x = d] + (1 - p(d)) p(x) [x ≠ d] / (1 - p(d)) = p(x), so the output has
the distribution of non-speculative sampling (tests/serving/runner/
test_spec_sampling.py checks it with a chi-square test). Greedy rows give
exactly the non-speculative tokens.

Penalties see the drafts: position j counts d_1..d_j as generated, as
sequential decoding would have by then. Token masks (structured output) come
per position, position j's assuming d_1..d_j, and apply first, as in `sample`.
Uniforms are seeded like `sample`'s: the draw of output index i uses
`fold_in(key(seed), i)` and its acceptance test `fold_in(fold_in(key(seed), i), 1)`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.runner.sampling.penalties import penalise, penalised_rows
from serving.runner.sampling.reductions import argmax, take
from serving.runner.sampling.sampler import (
    MIN_TEMPERATURE,
    _draw,
    _logprobs,
    _row_uniform,
    apply_token_mask,
)
from serving.runner.sampling.tensors import SamplingTensors
from serving.runner.sampling.thresholds import filter_thresholds
from serving.types import MAX_LOGPROBS


class VerifyOutput(NamedTuple):
  """Result of `verify`; device arrays. Row b emits `tokens[b, :num_accepted[b] + 1]`."""

  tokens: jax.Array  # [B, S] i32: kept drafts, then the token drawn after them; 0 beyond
  num_accepted: jax.Array  # [B] i32: drafts kept (0..num_drafts)
  logprob: jax.Array  # [B, S] f32: raw log_softmax of each emitted token
  top_ids: jax.Array  # [B, S, num_top] i32
  top_logprobs: jax.Array  # [B, S, num_top] f32


def expand_tensors(t: SamplingTensors, s: int) -> SamplingTensors:
  """[B] tensors -> [B * S]: row b's parameters at each of its S positions; position j
  samples output index `step + j`."""
  flat = jax.tree.map(lambda a: jnp.repeat(a, s, axis=0), t)
  steps = (t.step[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]).reshape(-1)
  return dataclasses.replace(flat, step=steps)


def draft_counts(output_counts: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:
  """Per-position output counts [B, S, V]: the row's counts plus d_1..d_j at position j."""
  b, s1 = drafts.shape
  s = s1 + 1
  counts = jnp.broadcast_to(output_counts[:, None, :], (b, s, output_counts.shape[-1]))
  j, i = jnp.meshgrid(jnp.arange(s), jnp.arange(s1), indexing="ij")  # [S, S-1]
  use = (i < j)[None] & (i[None] < num_drafts[:, None, None])  # draft i+1 counted at position j
  rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], use.shape)
  cols = jnp.broadcast_to(j[None], use.shape)
  toks = jnp.broadcast_to(drafts[:, None, :], use.shape)
  return counts.at[rows, cols, toks].add(use.astype(counts.dtype))


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, t: SamplingTensors,
           prompt_mask: jax.Array, output_counts: jax.Array, *, rows: jax.Array,
           allowed: jax.Array | None = None, num_top: int = MAX_LOGPROBS) -> VerifyOutput:
  """Accepts or rejects each row's drafts and draws the token after them (module doc).

  Args:
    logits: [B, S, V] target logits at each of the row's S positions.
    drafts: [B, S-1] i32 proposed tokens (d_1..d_{S-1}); entries past `num_drafts` ignored.
    num_drafts: [B] i32 drafts to verify per row, 0..S-1 (0: a plain decode row).
    t: the rows' sampling parameters [B]; `t.step` is the output index of position 0.
    prompt_mask, output_counts: [R, V] per-slot penalty state; `rows` [B] the slots.
    allowed: optional [B, S, ceil(V / 32)] int32 packed token masks per position
      (structured output: position j's mask assumes drafts 1..j); all ones for
      unconstrained rows. Logprobs stay the model's.
  """
  b, s, v = logits.shape
  raw = logits.astype(jnp.float32).reshape(b * s, v)
  masked = raw if allowed is None else apply_token_mask(raw, allowed.reshape(b * s, -1))
  tf = expand_tensors(t, s)

  def penalised():
    pm = jnp.repeat(prompt_mask[rows], s, axis=0)
    counts = draft_counts(output_counts[rows], drafts, num_drafts).reshape(b * s, v)
    return penalise(masked, tf, pm, counts)

  x = jax.lax.cond(jnp.any(penalised_rows(t)), penalised, lambda: masked)  # [B*S, V]
  greedy = argmax(x)  # [B*S]
  # d_{j+1}: the draft position j decides on (padding past S-1 and num_drafts).
  proposed = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, S]
  has_draft = jnp.arange(s)[None, :] < num_drafts[:, None]  # [B, S]
  is_random = t.temperature >= MIN_TEMPERATURE  # [B]

  def random_parts(x):
    temp = jnp.where(tf.temperature >= MIN_TEMPERATURE, tf.temperature, 1.0)
    z_max = take(x, greedy) / temp
    thr = filter_thresholds(x, temp, z_max, tf.top_k, tf.top_p, tf.min_p)
    z = x / temp[:, None]
    mass = jnp.sum(jnp.where(z >= thr[:, None], jnp.exp(z - z_max[:, None]), 0.0), axis=-1)
    z_d = take(z, proposed.reshape(-1))
    p_d = jnp.where(z_d >= thr, jnp.exp(z_d - z_max), 0.0) / mass  # [B*S]
    u = jax.vmap(_accept_uniform)(tf.seed, tf.step)
    return u < p_d, temp, z_max, thr

  def greedy_parts(x):
    zeros = jnp.zeros((b * s,), jnp.float32)
    return jnp.zeros((b * s,), jnp.bool_), jnp.ones((b * s,), jnp.float32), zeros, zeros

  any_random = jnp.any(is_random)
  rand_ok, temp, z_max, thr = jax.lax.cond(any_random, random_parts, greedy_parts, x)
  greedy_ok = proposed.reshape(-1) == greedy
  ok = jnp.where(jnp.repeat(is_random, s), rand_ok, greedy_ok).reshape(b, s) & has_draft
  num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]

  # The token after the kept drafts, at position a = num_accepted.
  at = jnp.arange(b) * s + num_accepted  # flat row of position a
  bonus_greedy = greedy[at]

  def bonus_random():
    xa = x[at]  # [B, V]
    excluded = jnp.where(num_accepted < num_drafts, proposed[jnp.arange(b), num_accepted], -1)
    keep = jnp.arange(v)[None, :] != excluded[:, None]
    xr = jnp.where(keep, xa, -jnp.inf)
    u = jax.vmap(_row_uniform)(tf.seed[at], tf.step[at])
    drawn = _draw(xr, temp[at], z_max[at], thr[at], u)
    # A residual without mass (p(d) rounded below 1 yet d rejected) keeps the argmax.
    z = xr / temp[at][:, None]
    left = jnp.any((z >= thr[at][:, None]) & keep, axis=-1)
    return jnp.where(is_random, jnp.where(left, drawn, bonus_greedy), bonus_greedy)

  bonus = jax.lax.cond(any_random, bonus_random, lambda: bonus_greedy)
  pos = jnp.arange(s)[None, :]
  tokens = jnp.where(pos < num_accepted[:, None], proposed,
                     jnp.where(pos == num_accepted[:, None], bonus[:, None], 0)).astype(jnp.int32)
  logprob, top_ids, top_lp = _logprobs(raw, tokens.reshape(-1), tf.num_logprobs, num_top)
  return VerifyOutput(tokens, num_accepted.astype(jnp.int32), logprob.reshape(b, s),
                      top_ids.reshape(b, s, num_top), top_lp.reshape(b, s, num_top))


def _accept_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
  """The acceptance test's U[0, 1) for output index `step`: independent of its draw's."""
  key = jax.random.wrap_key_data(seed, impl="threefry2x32")
  return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, step), 1), (),
                            jnp.float32)
