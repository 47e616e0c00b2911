"""`sample`: one token per row from penalised, filtered logits; and its logprobs.

The pipeline and its decisions are in the package doc (sampling/__init__.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.runner.sampling.penalties import penalise, penalised_rows
from serving.runner.sampling.reductions import BLOCK, argmax, blocked, take, top_n
from serving.runner.sampling.tensors import SampleOutput, SamplingTensors
from serving.runner.sampling.thresholds import filter_thresholds
from serving.types import MAX_LOGPROBS

# Rows with a lower temperature are greedy (vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5


def sample(logits: jax.Array, t: SamplingTensors, prompt_mask: jax.Array,
           output_counts: jax.Array, *, rows: jax.Array | None = None,
           allowed: jax.Array | None = None, num_top: int = MAX_LOGPROBS) -> SampleOutput:
  """Samples one token per row; pure and jit-able (`num_top` static).

  Args:
    logits: [B, V] float logits of the next token.
    t: per-row parameters (`SamplingTensors.build`).
    prompt_mask: [B, V] bool, token appears in the row's prompt; or [R, V]
      per-slot state when `rows` is given.
    output_counts: [B, V] int, times the token was generated so far; or [R, V].
    rows: optional [B] i32 decode slot of each row into the [R, V] state of R
      slots. The gather then happens only when some row has a penalty, which
      saves two [B, V] copies a step otherwise.
    allowed: optional [B, ceil(V / 32)] int32 packed token masks (bit v % 32 of word
      v // 32 set: token v may be sampled); all ones for unconstrained rows. The
      logprobs stay the model's (taken before the mask).
    num_top: width of `top_ids` / `top_logprobs` (static).
  Returns:
    SampleOutput with tokens [B] i32, logprob [B], top_ids / top_logprobs [B, num_top].
  """
  raw = logits.astype(jnp.float32)
  constrained = raw if allowed is None else apply_token_mask(raw, allowed)

  def tokens_of(x):  # [B, V] -> [B]; conds return [B] arrays only, never [B, V] copies
    greedy = argmax(x)
    return jax.lax.cond(jnp.any(t.temperature >= MIN_TEMPERATURE), _random_tokens,
                        lambda x, t, g: g, x, t, greedy)

  def penalised():
    if rows is None:
      return penalise(constrained, t, prompt_mask, output_counts)
    return penalise(constrained, t, prompt_mask[rows], output_counts[rows])

  tokens = jax.lax.cond(jnp.any(penalised_rows(t)), lambda: tokens_of(penalised()),
                        lambda: tokens_of(constrained))
  logprob, top_ids, top_logprobs = _logprobs(raw, tokens, t.num_logprobs, num_top)
  return SampleOutput(tokens, logprob, top_ids, top_logprobs)


def apply_token_mask(x: jax.Array, allowed: jax.Array) -> jax.Array:
  """x [B, V] with the tokens `allowed` [B, ceil(V / 32)] (packed bits) does not set at -inf."""
  b, v = x.shape
  bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
  keep = bits.reshape(b, -1)[:, :v].astype(jnp.bool_)
  return jnp.where(keep, x, -jnp.inf)


def _random_tokens(x: jax.Array, t: SamplingTensors, greedy: jax.Array) -> jax.Array:
  """Tokens of a batch with at least one random row; greedy rows keep `greedy`.

  x are the penalised logits [B, V]. The scaled logits x / temperature are
  recomputed inside each pass (fused) rather than stored.
  """
  is_random = t.temperature >= MIN_TEMPERATURE
  temperature = jnp.where(is_random, t.temperature, 1.0)
  z_max = take(x, greedy) / temperature  # = max(x / T): the greedy token holds the max
  thr = filter_thresholds(x, temperature, z_max, t.top_k, t.top_p, t.min_p)
  u = jax.vmap(_row_uniform)(t.seed, t.step)  # [B]
  drawn = _draw(x, temperature, z_max, thr, u)
  return jnp.where(is_random, drawn, greedy)


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
  """U[0, 1) of one row from `fold_in(key(seed), step)`; seed is [2] u32 key data."""
  key = jax.random.wrap_key_data(seed, impl="threefry2x32")
  return jax.random.uniform(jax.random.fold_in(key, step), (), jnp.float32)


def _draw(x: jax.Array, temperature: jax.Array, z_max: jax.Array, thr: jax.Array,
          u: jax.Array) -> jax.Array:
  """Inverse-CDF draw, in vocabulary order, from softmax(z) restricted to z >= thr.

  z = x / temperature[:, None]. Two levels (blocks of BLOCK tokens, then
  within the chosen block) keep it one fused pass over [B, V]. The chosen
  token always has positive probability, whatever the rounding.
  """
  b, v = x.shape
  scale = temperature[:, None, None]
  blocks = blocked(x, -jnp.inf)  # [B, nb, BLOCK]

  def probs(xb):  # [B, n, BLOCK] logits -> unnormalised kept probabilities
    z = xb / scale
    return jnp.where(z >= thr[:, None, None], jnp.exp(z - z_max[:, None, None]), 0.0)

  block_mass = jnp.sum(probs(blocks), axis=-1)  # [B, nb]
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  target = u * block_cdf[:, -1]  # [B]
  blk = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), _last_positive(block_mass))
  before = jnp.where(blk > 0, take(block_cdf, jnp.maximum(blk - 1, 0)), 0.0)
  inner = probs(jnp.take_along_axis(blocks, blk[:, None, None], axis=1))[:, 0]  # [B, BLOCK]
  inner_cdf = before[:, None] + jnp.cumsum(inner, axis=-1)
  pos = jnp.minimum(jnp.sum(inner_cdf <= target[:, None], axis=-1), _last_positive(inner))
  return jnp.minimum(blk * BLOCK + pos, v - 1).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
  """Index of the last positive entry of each row of [B, N] (0 if none)."""
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def _logprobs(raw: jax.Array, tokens: jax.Array, num_logprobs: jax.Array,
              num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Raw log_softmax of the sampled tokens and the top `num_top`; zeros when unwanted."""
  b = raw.shape[0]
  zeros = (jnp.zeros((b,), jnp.float32), jnp.zeros((b, num_top), jnp.int32),
           jnp.zeros((b, num_top), jnp.float32))

  def compute(raw):
    lse = jax.nn.logsumexp(raw, axis=-1)
    logprob = take(raw, tokens) - lse
    if not num_top:
      return logprob, zeros[1], zeros[2]
    top_vals, top_ids = jax.lax.cond(
        jnp.any(num_logprobs > 0), lambda x: top_n(x, num_top),
        lambda x: (zeros[2], zeros[1]), raw)
    return logprob, top_ids, top_vals - lse[:, None]

  return jax.lax.cond(jnp.any(num_logprobs >= 0), compute, lambda raw: zeros, raw)
