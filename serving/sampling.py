"""On-device token sampling: penalties, temperature, top-k, top-p, min-p, logprobs.

Everything here is a pure, jit-friendly function of arrays. Per-request values
travel as `[B]` arrays in `SamplingTensors`, so ONE compiled program serves every
mix of parameters in a batch (no recompiles after warm-up).

Pipeline of `sample` (vLLM order):
  1. penalties on the raw logits: repetition (prompt and output tokens),
     frequency and presence (output tokens only);
  2. greedy rows (temperature < MIN_TEMPERATURE, as vLLM) take the argmax of
     the penalised logits;
  3. random rows divide by their temperature, then keep the tokens that pass
     top-k, then top-p (over the top-k renormalised distribution), then min-p;
  4. a draw by inverse CDF with one uniform per row from the key
     `fold_in(key(seed), step)`, so a request samples the same tokens whatever
     batch or row it lands in;
  5. logprobs of the sampled token and the top `num_top` tokens, taken from the
     log_softmax of the RAW logits (vLLM's default `raw_logprobs`).

Every filter is a per-row threshold on the scaled logits ("keep z >= thr"), so
no `[B, V]` sort is ever done (XLA:CPU sorts 32 x 49152 in ~0.5 s): top-k and
top-p read the top `TOP_K_CAP` values (a two-level `lax.top_k`); a row that
needs more (top_k > cap, or a nucleus wider than the cap: a third of the rows
of SmolLM2 at T=1, p=0.95) gets an exact search over the float order instead,
a few rows at a time. Each optional stage sits behind `lax.cond` on "any row
needs it", so an all-greedy batch pays for an argmax only.

Decisions: the draw is an inverse CDF over the vocabulary with one uniform a
row, not Gumbel-max (B x V random numbers: ~35 ms vs ~2 ms at 32 x 49152 on
CPU), and exactly as deterministic. Min-p comes after top-k / top-p (vLLM v0
order; v1 applies it first); ties at a top-k / top-p boundary are all kept.

The runner keeps per-slot penalty state `prompt_mask [S, V] bool` and
`output_counts [S, V] i32` on device; `reset_slots`, `record_prompt` and
`record_outputs` are the pure scatter updates for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.types import MAX_LOGPROBS, SamplingParams

# Rows with a lower temperature are greedy (vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
# Width of the `lax.top_k` fast path for top-k / top-p thresholds.
TOP_K_CAP = 256
# A narrower one for batches with top-k only, all k at most this (20, 40, 50...).
_SMALL_TOP_K = 64
# Block width of the two-level argmax and inverse-CDF draw.
_BLOCK = 128
# Rows the threshold search handles at once.
_SEARCH_CHUNK = 4
# Key-midpoint halvings that pin any threshold: int32 keys span 2**32 values.
_KEY_HALVINGS = 32
# The threshold search reads out a row's interval once it holds this many tokens.
_SEARCH_TAIL = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
  """Per-row sampling parameters of a batch; every field is a `[B]` (or `[B, 2]`) array.

  Neutral values disable a stage: temperature 0 (any value < MIN_TEMPERATURE)
  is greedy, top_k <= 0, top_p 1, min_p 0, repetition_penalty 1,
  presence/frequency penalty 0, num_logprobs -1 (no logprobs wanted; 0 wants
  the sampled token's logprob only).
  """

  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] i32
  top_p: jax.Array  # [B] f32
  min_p: jax.Array  # [B] f32
  repetition_penalty: jax.Array  # [B] f32
  presence_penalty: jax.Array  # [B] f32
  frequency_penalty: jax.Array  # [B] f32
  seed: jax.Array  # [B, 2] u32: (seed >> 32, seed & 0xffffffff), threefry key data
  step: jax.Array  # [B] i32: index of the output token being generated
  num_logprobs: jax.Array  # [B] i32: SamplingParams.logprobs, -1 for None

  @staticmethod
  def build(params: Sequence[SamplingParams | None], seeds: Sequence[int],
            steps: Sequence[int], batch_size: int) -> SamplingTensors:
    """Host-side (numpy) tensors for a batch of `batch_size` rows.

    Row i takes `params[i]`, `seeds[i]` and `steps[i]`; rows past `len(params)`
    and rows whose params are None are padding (greedy, neutral, no logprobs).
    The caller chooses a seed for requests without one.
    """
    if len(params) > batch_size:
      raise ValueError(f"{len(params)=} rows do not fit {batch_size=}")
    if len(seeds) != len(params) or len(steps) != len(params):
      raise ValueError(f"need one seed and step per row: {len(params)=}, "
                       f"{len(seeds)=}, {len(steps)=}")
    rows = [_NEUTRAL if p is None else (
        p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
        p.frequency_penalty, -1 if p.logprobs is None else p.logprobs) for p in params]
    cols = np.array(rows + [_NEUTRAL] * (batch_size - len(params)), np.float64).T  # [8, B]
    seed = np.zeros((batch_size, 2), np.uint32)
    seed64 = np.array(seeds, np.uint64)
    seed[:len(params), 0] = seed64 >> np.uint64(32)
    seed[:len(params), 1] = seed64 & np.uint64(0xFFFFFFFF)
    step = np.zeros(batch_size, np.int32)
    step[:len(params)] = steps
    f32, i32 = lambda c: c.astype(np.float32), lambda c: c.astype(np.int32)
    return SamplingTensors(
        temperature=f32(cols[0]), top_k=i32(cols[1]), top_p=f32(cols[2]), min_p=f32(cols[3]),
        repetition_penalty=f32(cols[4]), presence_penalty=f32(cols[5]),
        frequency_penalty=f32(cols[6]), seed=seed, step=step, num_logprobs=i32(cols[7]))


# A padding row: greedy, neutral, no logprobs (the column order of `build`).
_NEUTRAL = (0.0, -1, 1.0, 0.0, 1.0, 0.0, 0.0, -1)


class SampleOutput(NamedTuple):
  """Result of `sample`; device arrays. Logprobs are zeros when no row asked for them."""

  tokens: jax.Array  # [B] i32
  logprob: jax.Array  # [B] f32: raw log_softmax of the sampled token
  top_ids: jax.Array  # [B, num_top] i32, best first
  top_logprobs: jax.Array  # [B, num_top] f32, descending


def sample(logits: jax.Array, t: SamplingTensors, prompt_mask: jax.Array,
           output_counts: jax.Array, *, rows: jax.Array | None = None,
           num_top: int = MAX_LOGPROBS) -> SampleOutput:
  """Samples one token per row; pure and jit-able (`num_top` static).

  Args:
    logits: [B, V] float logits of the next token.
    t: per-row parameters (`SamplingTensors.build`).
    prompt_mask: [B, V] bool, token appears in the row's prompt; or [S, V]
      per-slot state when `rows` is given.
    output_counts: [B, V] int, times the token was generated so far; or [S, V].
    rows: optional [B] i32 slot of each row into [S, V] state. The gather then
      happens only when some row has a penalty, which saves two [B, V] copies
      a step otherwise.
    num_top: width of `top_ids` / `top_logprobs` (static).
  Returns:
    SampleOutput with tokens [B] i32, logprob [B], top_ids / top_logprobs [B, num_top].
  """
  raw = logits.astype(jnp.float32)

  def tokens_of(x):  # [B, V] -> [B]; conds return [B] arrays only, never [B, V] copies
    greedy = _argmax(x)
    return jax.lax.cond(jnp.any(t.temperature >= MIN_TEMPERATURE), _random_tokens,
                        lambda x, t, g: g, x, t, greedy)

  def penalised():
    if rows is None:
      return _penalise(raw, t, prompt_mask, output_counts)
    return _penalise(raw, t, prompt_mask[rows], output_counts[rows])

  tokens = jax.lax.cond(jnp.any(_penalised_rows(t)), lambda: tokens_of(penalised()),
                        lambda: tokens_of(raw))
  logprob, top_ids, top_logprobs = _logprobs(raw, tokens, t.num_logprobs, num_top)
  return SampleOutput(tokens, logprob, top_ids, top_logprobs)


def _penalised_rows(t: SamplingTensors) -> jax.Array:
  """[B] bool: rows with a non-neutral penalty."""
  return ((t.repetition_penalty != 1) | (t.frequency_penalty != 0)
          | (t.presence_penalty != 0))


def _penalise(x: jax.Array, t: SamplingTensors, prompt_mask: jax.Array,
              output_counts: jax.Array) -> jax.Array:
  """vLLM / OpenAI penalties on [B, V] f32 logits; neutral rows come back unchanged.

  Repetition: a token seen in the prompt or output has a positive logit divided
  by the penalty and a negative one multiplied. Then
  `logit -= frequency * count + presence * (count > 0)` over output tokens.
  """
  counts = output_counts.astype(jnp.float32)
  in_output = output_counts > 0
  rep = t.repetition_penalty[:, None]
  seen = prompt_mask | in_output
  x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
  x = x - t.frequency_penalty[:, None] * counts
  return x - t.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _random_tokens(x: jax.Array, t: SamplingTensors, greedy: jax.Array) -> jax.Array:
  """Tokens of a batch with at least one random row; greedy rows keep `greedy`.

  x are the penalised logits [B, V]. The scaled logits x / temperature are
  recomputed inside each pass (fused) rather than stored.
  """
  is_random = t.temperature >= MIN_TEMPERATURE
  temperature = jnp.where(is_random, t.temperature, 1.0)
  z_max = _take(x, greedy) / temperature  # = max(x / T): the greedy token holds the max
  thr = filter_thresholds(x, temperature, z_max, t.top_k, t.top_p, t.min_p)
  u = jax.vmap(_row_uniform)(t.seed, t.step)  # [B]
  drawn = _draw(x, temperature, z_max, thr, u)
  return jnp.where(is_random, drawn, greedy)


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
  """U[0, 1) of one row from `fold_in(key(seed), step)`; seed is [2] u32 key data."""
  key = jax.random.wrap_key_data(seed, impl="threefry2x32")
  return jax.random.uniform(jax.random.fold_in(key, step), (), jnp.float32)


def filter_thresholds(x: jax.Array, temperature: jax.Array, z_max: jax.Array,
                      top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
  """Per-row threshold [B] f32: the row keeps the tokens with `z >= thr`.

  z = x / temperature[:, None] are the scaled logits ([B, V], temperature > 0)
  and z_max [B] their row max. Top-k keeps the k largest (ties at the k-th value
  kept); top-p the smallest prefix, sorted descending, of the top-k
  renormalised distribution such that the mass before each kept token is
  < p; min-p the tokens whose probability is at least `min_p` times the
  largest.
  """
  v = x.shape[-1]
  need_k = (top_k > 0) & (top_k < v)
  need_p = top_p < 1
  k = jnp.where(need_k, top_k, v)
  scaled = lambda: x / temperature[:, None]  # recomputed in each consumer, never stored
  small = min(_SMALL_TOP_K, v)

  def small_top_k():  # only top-k rows, every k <= _SMALL_TOP_K: one cheap top-n
    vals, _ = _top_n(scaled(), small)
    return jnp.where(need_k, _take(vals, jnp.clip(k - 1, 0, small - 1)), -jnp.inf)

  general = lambda: _top_k_top_p(scaled(), z_max, k, jnp.where(need_p, top_p, 1.0))
  thr = jax.lax.cond(
      jnp.any(need_k | need_p),
      lambda: jax.lax.cond(jnp.any(need_p | (need_k & (k > small))), general, small_top_k),
      lambda: jnp.full(x.shape[:1], -jnp.inf, jnp.float32))
  thr_min_p = jnp.where(min_p > 0, z_max + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
  return jnp.maximum(thr, thr_min_p)


def _top_k_top_p(z: jax.Array, z_max: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """Top-k / top-p threshold from the top TOP_K_CAP values, else by `_search_thresholds`.

  k is in [1, V] (V: disabled) and p in (0, 1] (1: disabled).
  """
  v = z.shape[-1]
  cap = min(TOP_K_CAP, v)
  vals, _ = _top_n(z, cap)  # [B, cap] descending
  thr_k = jnp.where(k <= cap, _take(vals, jnp.clip(k - 1, 0, cap - 1)), -jnp.inf)
  thr_k = jnp.where(k >= v, -jnp.inf, thr_k)
  mass = jax.lax.cond(  # the top-k renormaliser; only top-p needs it
      jnp.any(p < 1), lambda: jnp.sum(jnp.where(z >= thr_k[:, None], jnp.exp(z - z_max[:, None]),
                                                0.0), axis=-1),
      lambda: jnp.ones_like(z_max))
  q = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - z_max[:, None]), 0.0) / mass[:, None]
  incl = jnp.cumsum(q, axis=-1)  # [B, cap]
  excl = jnp.concatenate([jnp.zeros_like(incl[:, :1]), incl[:, :-1]], axis=-1)
  n_keep = jnp.sum(excl < p[:, None], axis=-1)  # >= 1
  thr_p = jnp.where(p < 1, _take(vals, n_keep - 1), -jnp.inf)
  k_fits = (k <= cap) | (k >= v)
  fits = k_fits & ((p >= 1) | (incl[:, -1] >= p))
  fast = jnp.maximum(thr_k, thr_p)
  return jax.lax.cond(jnp.all(fits), lambda: fast,
                      lambda: _search_rows(z, z_max, k, p, thr_k, k_fits, fits, fast))


def _search_rows(z, z_max, k, p, thr_k, k_fits, fits, fast):
  """`fast`, with the rows that do not fit it replaced by `_search_thresholds`.

  Those rows go through in chunks of `_SEARCH_CHUNK` (a while loop), so the
  common case of a few wide rows costs a fraction of a full-batch pass.
  """
  b = z.shape[0]
  chunk = min(_SEARCH_CHUNK, b)
  n_chunks = -(-b // chunk)
  order = jnp.argsort(fits, stable=True)  # rows that do not fit first
  order = jnp.concatenate([order, order[:n_chunks * chunk - b]])  # repeats are harmless

  def body(i, thr):
    rows = jax.lax.dynamic_slice_in_dim(order, i * chunk, chunk)
    sub = _search_thresholds(z[rows], z_max[rows], k[rows], p[rows], thr_k[rows], k_fits[rows])
    # Rows that fit keep the fast result: a row's threshold never depends on its neighbours.
    return thr.at[rows].set(jnp.where(fits[rows], fast[rows], sub))

  n_slow = jnp.sum(~fits)
  return jax.lax.fori_loop(0, (n_slow + chunk - 1) // chunk, body, fast)


def _search_thresholds(z: jax.Array, z_max: jax.Array, k: jax.Array, p: jax.Array,
                       thr_k_fast: jax.Array, k_fits: jax.Array) -> jax.Array:
  """Exact top-k / top-p thresholds [B] by a search over the float order of z.

  No sort: each search step is one masked reduction over [B, V]; once a row's
  interval holds at most `_SEARCH_TAIL` tokens they are read out with a
  small top-n and finished exactly. `thr_k_fast` serves rows whose top-k
  fitted the fast path (`k_fits`).
  """
  keys = _order_key(z)  # [B, V] i32, monotone in z
  finite = z > -jnp.inf
  lo0 = jnp.min(jnp.where(finite, keys, jnp.iinfo(jnp.int32).max), axis=-1)
  hi0 = jnp.max(keys, axis=-1)
  n_finite = jnp.sum(finite, axis=-1, dtype=jnp.int32)

  def top_k_threshold():  # the k-th largest: largest tau with count(keys >= tau) >= k
    def split(mid):
      n_ge = jnp.sum(keys >= mid[:, None], axis=-1, dtype=jnp.int32)
      return n_ge >= k, n_ge, None

    lo, hi, n_gt_hi, _ = _search(keys, z, jnp.where(k_fits, hi0, lo0), hi0, n_finite, split,
                                 upper=True)
    cand = _interval_top(keys, z, lo, hi)
    tau = _take(cand, jnp.clip(k - n_gt_hi - 1, 0, _SEARCH_TAIL - 1))
    return jnp.where(k_fits, thr_k_fast, jnp.where(lo == hi, _from_order_key(lo), tau))

  thr_k = jax.lax.cond(jnp.all(k_fits), lambda: thr_k_fast, top_k_threshold)
  e = jnp.where(z >= thr_k[:, None], jnp.exp(z - z_max[:, None]), 0.0)
  total = jnp.sum(e, axis=-1)
  q = e / total[:, None]

  def split(mid):  # smallest tau with mass(keys > tau) < p
    above = keys > mid[:, None]
    mass = jnp.sum(jnp.where(above, q, 0.0), axis=-1)
    return mass < p, jnp.sum(above, axis=-1, dtype=jnp.int32), mass

  lo, hi, _, mass_gt_hi = _search(keys, z, jnp.where(p < 1, lo0, hi0), hi0, n_finite, split,
                                  upper=False)
  cand = _interval_top(keys, z, lo, hi)  # [B, tail] descending
  q_cand = jnp.where(cand >= thr_k[:, None], jnp.exp(cand - z_max[:, None]), 0.0) / total[:, None]
  mass_before = mass_gt_hi[:, None] + jnp.cumsum(q_cand, axis=-1) - q_cand
  n_keep = jnp.sum((mass_before < p[:, None]) & (cand > -jnp.inf), axis=-1)
  tau = jnp.where(n_keep > 0, _take(cand, jnp.maximum(n_keep - 1, 0)), _from_order_key(hi))
  thr_p = jnp.where(lo == hi, _from_order_key(hi), tau)
  return jnp.maximum(thr_k, jnp.where(p < 1, thr_p, -jnp.inf))


def _search(keys, z, lo, hi, n_ge_lo, split, *, upper: bool):
  """Shrinks [lo, hi] (int32 order keys, [B]) around a threshold tau.

  `split(mid) -> (mid_ok, n, mass)`: mid_ok says mid bounds tau (`upper`
  searches, for the largest tau with a property: tau >= mid, the interval
  becomes [mid, hi]; else tau <= mid, it becomes [lo, mid]); n counts the
  keys >= mid (`upper`) or > mid, and mass is carried for the `> hi` side.
  Stops per row when lo == hi or at most `_SEARCH_TAIL` keys remain in
  [lo, hi]; steps alternate between the value midpoint (fast on smooth data)
  and the key midpoint (at most 32 halvings).
  Returns (lo, hi, count(keys > hi), mass above hi).
  """
  b = keys.shape[0]
  state = (jnp.int32(0), lo, hi, n_ge_lo, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32))

  def active(lo, hi, n_ge_lo, n_gt_hi):
    return (lo < hi) & (n_ge_lo - n_gt_hi > _SEARCH_TAIL)

  def cond(state):
    i, lo, hi, n_ge_lo, n_gt_hi, _ = state
    return (i < 2 * _KEY_HALVINGS) & jnp.any(active(lo, hi, n_ge_lo, n_gt_hi))

  def body(state):
    i, lo, hi, n_ge_lo, n_gt_hi, mass_gt_hi = state
    up = int(upper)
    key_mid = (lo >> 1) + (hi >> 1) + (((lo | hi) if upper else (lo & hi)) & 1)
    lo_v, hi_v = _from_order_key(lo), _from_order_key(hi)
    value_mid = jnp.clip(_order_key(lo_v + (hi_v - lo_v) * 0.5), lo + up, hi - 1 + up)
    mid = jnp.where(i % 2 == 1, value_mid, key_mid)
    mid_ok, n, mass = split(mid)
    live = active(lo, hi, n_ge_lo, n_gt_hi)
    yes, no = mid_ok & live, ~mid_ok & live
    if upper:  # yes: tau >= mid; no: tau <= mid - 1 (n counts keys >= mid = keys > mid - 1)
      return (i + 1, jnp.where(yes, mid, lo), jnp.where(no, mid - 1, hi),
              jnp.where(yes, n, n_ge_lo), jnp.where(no, n, n_gt_hi), mass_gt_hi)
    # yes: tau <= mid; no: tau >= mid + 1 (n counts keys > mid = keys >= mid + 1)
    return (i + 1, jnp.where(no, mid + 1, lo), jnp.where(yes, mid, hi),
            jnp.where(no, n, n_ge_lo), jnp.where(yes, n, n_gt_hi),
            jnp.where(yes, mass, mass_gt_hi))

  _, lo, hi, _, n_gt_hi, mass_gt_hi = jax.lax.while_loop(cond, body, state)
  return lo, hi, n_gt_hi, mass_gt_hi


def _interval_top(keys: jax.Array, z: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  """The `_SEARCH_TAIL` largest z with key in [lo, hi] per row, descending (-inf pads)."""
  inside = (keys >= lo[:, None]) & (keys <= hi[:, None])
  vals, _ = _top_n(jnp.where(inside, z, -jnp.inf), _SEARCH_TAIL)
  return vals


def _order_key(x: jax.Array) -> jax.Array:
  """int32 keys with the order of float32 x (an involution on the bit pattern)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_order_key(key: jax.Array) -> jax.Array:
  """Inverse of `_order_key`."""
  bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _draw(x: jax.Array, temperature: jax.Array, z_max: jax.Array, thr: jax.Array,
          u: jax.Array) -> jax.Array:
  """Inverse-CDF draw, in vocabulary order, from softmax(z) restricted to z >= thr.

  z = x / temperature[:, None]. Two levels (blocks of _BLOCK tokens, then
  within the chosen block) keep it one fused pass over [B, V]. The chosen
  token always has positive probability, whatever the rounding.
  """
  b, v = x.shape
  scale = temperature[:, None, None]
  blocks = _blocked(x, -jnp.inf)  # [B, nb, _BLOCK]

  def probs(xb):  # [B, n, _BLOCK] logits -> unnormalised kept probabilities
    z = xb / scale
    return jnp.where(z >= thr[:, None, None], jnp.exp(z - z_max[:, None, None]), 0.0)

  block_mass = jnp.sum(probs(blocks), axis=-1)  # [B, nb]
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  target = u * block_cdf[:, -1]  # [B]
  blk = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), _last_positive(block_mass))
  before = jnp.where(blk > 0, _take(block_cdf, jnp.maximum(blk - 1, 0)), 0.0)
  inner = probs(jnp.take_along_axis(blocks, blk[:, None, None], axis=1))[:, 0]  # [B, _BLOCK]
  inner_cdf = before[:, None] + jnp.cumsum(inner, axis=-1)
  pos = jnp.minimum(jnp.sum(inner_cdf <= target[:, None], axis=-1), _last_positive(inner))
  return jnp.minimum(blk * _BLOCK + pos, v - 1).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
  """Index of the last positive entry of each row of [B, N] (0 if none)."""
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def _argmax(x: jax.Array) -> jax.Array:
  """Row argmax of [B, V] (first maximum), in two levels: ~7x faster than jnp.argmax on CPU."""
  blocks = _blocked(x, -jnp.inf)  # [B, nb, _BLOCK]
  blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
  return (blk * _BLOCK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _blocked(x: jax.Array, fill: float, block: int = _BLOCK) -> jax.Array:
  """[B, V] -> [B, ceil(V / block), block], padding the tail with `fill`."""
  b, v = x.shape
  pad = -v % block
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
  # [B, V + pad] -> [B, nb, block]
  return x.reshape(b, (v + pad) // block, block)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, idx[b]] for [B, N] x and [B] idx."""
  return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]


def _logprobs(raw: jax.Array, tokens: jax.Array, num_logprobs: jax.Array,
              num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Raw log_softmax of the sampled tokens and the top `num_top`; zeros when unwanted."""
  b = raw.shape[0]
  zeros = (jnp.zeros((b,), jnp.float32), jnp.zeros((b, num_top), jnp.int32),
           jnp.zeros((b, num_top), jnp.float32))

  def compute(raw):
    lse = jax.nn.logsumexp(raw, axis=-1)
    logprob = _take(raw, tokens) - lse
    if not num_top:
      return logprob, zeros[1], zeros[2]
    top_vals, top_ids = jax.lax.cond(
        jnp.any(num_logprobs > 0), lambda x: _top_n(x, num_top),
        lambda x: (zeros[2], zeros[1]), raw)
    return logprob, top_ids, top_vals - lse[:, None]

  return jax.lax.cond(jnp.any(num_logprobs >= 0), compute, lambda raw: zeros, raw)


def _top_n(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """(values, ids) of the n largest entries of each row of [B, V], descending.

  Two levels when that saves work: the n largest values lie in the n blocks
  with the largest block maxima, so `lax.top_k` runs over those blocks only
  (5x faster than over V at V=49152). Pads with (-inf, id 0) when V < n.
  """
  b, v = x.shape
  block = 128 if n <= 32 else 16
  nb = -(-v // block)
  if nb < 4 * n:
    vals, ids = jax.lax.top_k(x, min(n, v))
  else:
    blocks = _blocked(x, -jnp.inf, block)  # [B, nb, block]
    _, top_blocks = jax.lax.top_k(jnp.max(blocks, axis=-1), n)  # [B, n]
    cand = jnp.take_along_axis(blocks, top_blocks[:, :, None], axis=1)
    vals, pos = jax.lax.top_k(cand.reshape(b, n * block), n)  # [B, n * block] -> [B, n]
    ids = jnp.minimum(jnp.take_along_axis(top_blocks, pos // block, axis=1) * block
                      + pos % block, v - 1)
  pad = n - vals.shape[-1]
  if pad:
    vals = jnp.pad(vals, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    ids = jnp.pad(ids, ((0, 0), (0, pad)))
  return vals, ids.astype(jnp.int32)


# ----------------------------------------------------------------------------
# Per-slot penalty state, kept by the runner on device.


def reset_slots(prompt_mask: jax.Array, output_counts: jax.Array,
                slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Clears the penalty state of `slots` [N] i32 (a slot given to a new request).

  prompt_mask [S, V] bool and output_counts [S, V] i32 are the per-slot state;
  slot ids outside [0, S) are padding and ignored. Returns the new
  (prompt_mask, output_counts).
  """
  slots = jnp.where(slots < 0, prompt_mask.shape[0], slots)
  return (prompt_mask.at[slots].set(False, mode="drop"),
          output_counts.at[slots].set(0, mode="drop"))


def record_prompt(prompt_mask: jax.Array, slots: jax.Array, token_ids: jax.Array) -> jax.Array:
  """Marks prompt tokens: prompt_mask[slots[n], token_ids[n, l]] = True.

  slots [N] i32 (ids outside [0, S) are padding); token_ids [N, L] i32, where
  negative ids are padding. Call once per prefill chunk; marks accumulate.
  Returns the new mask.
  """
  s, v = prompt_mask.shape
  rows = jnp.broadcast_to(slots[:, None], token_ids.shape)
  cols = jnp.where((token_ids < 0) | (rows < 0), v, token_ids)
  rows = jnp.where(rows < 0, s, rows)
  return prompt_mask.at[rows, cols].set(True, mode="drop")


def record_outputs(output_counts: jax.Array, slots: jax.Array, tokens: jax.Array) -> jax.Array:
  """Counts one generated token per row: output_counts[slots[n], tokens[n]] += 1.

  slots [N] i32 (ids outside [0, S) are padding), tokens [N] i32 (negative
  ids are padding). Returns the new counts.
  """
  s, v = output_counts.shape
  cols = jnp.where((tokens < 0) | (slots < 0), v, tokens)
  rows = jnp.where(slots < 0, s, slots)
  return output_counts.at[rows, cols].add(1, mode="drop")
