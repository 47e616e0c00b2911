"""Top-k, top-p and min-p as per-row thresholds on the scaled logits.

Every filter is "keep z >= thr", so no `[B, V]` sort is ever done (XLA:CPU
sorts 32 x 49152 in ~0.5 s): top-k and top-p read the top `TOP_K_CAP`
values (a two-level `lax.top_k`); a row that needs more (top_k > cap, or a
nucleus wider than the cap) gets an exact search over the float order
instead (`search_thresholds`), a few rows at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.runner.sampling.reductions import take, top_n

# Width of the `lax.top_k` fast path for top-k / top-p thresholds.
TOP_K_CAP = 256
# A narrower one for batches with top-k only, all k at most this (20, 40, 50...).
_SMALL_TOP_K = 64
# Rows the threshold search handles at once.
SEARCH_CHUNK = 4
# Key-midpoint halvings that pin any threshold: int32 keys span 2**32 values.
_KEY_HALVINGS = 32
# The threshold search reads out a row's interval once it holds this many tokens.
_SEARCH_TAIL = 32


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
    vals, _ = top_n(scaled(), small)
    return jnp.where(need_k, take(vals, jnp.clip(k - 1, 0, small - 1)), -jnp.inf)

  general = lambda: _top_k_top_p(scaled(), z_max, k, jnp.where(need_p, top_p, 1.0))
  thr = jax.lax.cond(
      jnp.any(need_k | need_p),
      lambda: jax.lax.cond(jnp.any(need_p | (need_k & (k > small))), general, small_top_k),
      lambda: jnp.full(x.shape[:1], -jnp.inf, jnp.float32))
  thr_min_p = jnp.where(min_p > 0, z_max + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
  return jnp.maximum(thr, thr_min_p)


def _top_k_top_p(z: jax.Array, z_max: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """Top-k / top-p threshold from the top TOP_K_CAP values, else by `search_thresholds`.

  k is in [1, V] (V: disabled) and p in (0, 1] (1: disabled).
  """
  v = z.shape[-1]
  cap = min(TOP_K_CAP, v)
  vals, _ = top_n(z, cap)  # [B, cap] descending
  thr_k = jnp.where(k <= cap, take(vals, jnp.clip(k - 1, 0, cap - 1)), -jnp.inf)
  thr_k = jnp.where(k >= v, -jnp.inf, thr_k)
  mass = jax.lax.cond(  # the top-k renormaliser; only top-p needs it
      jnp.any(p < 1), lambda: jnp.sum(jnp.where(z >= thr_k[:, None], jnp.exp(z - z_max[:, None]),
                                                0.0), axis=-1),
      lambda: jnp.ones_like(z_max))
  q = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - z_max[:, None]), 0.0) / mass[:, None]
  incl = jnp.cumsum(q, axis=-1)  # [B, cap]
  excl = jnp.concatenate([jnp.zeros_like(incl[:, :1]), incl[:, :-1]], axis=-1)
  n_keep = jnp.sum(excl < p[:, None], axis=-1)  # >= 1
  thr_p = jnp.where(p < 1, take(vals, n_keep - 1), -jnp.inf)
  k_fits = (k <= cap) | (k >= v)
  fits = k_fits & ((p >= 1) | (incl[:, -1] >= p))
  fast = jnp.maximum(thr_k, thr_p)
  return jax.lax.cond(jnp.all(fits), lambda: fast,
                      lambda: _search_rows(z, z_max, k, p, thr_k, k_fits, fits, fast))


def _search_rows(z, z_max, k, p, thr_k, k_fits, fits, fast):
  """`fast`, with the rows that do not fit it replaced by `search_thresholds`.

  Those rows go through in chunks of `SEARCH_CHUNK` (a while loop), so the
  common case of a few wide rows costs a fraction of a full-batch pass.
  """
  b = z.shape[0]
  chunk = min(SEARCH_CHUNK, b)
  n_chunks = -(-b // chunk)
  order = jnp.argsort(fits, stable=True)  # rows that do not fit first
  order = jnp.concatenate([order, order[:n_chunks * chunk - b]])  # repeats are harmless

  def body(i, thr):
    rows = jax.lax.dynamic_slice_in_dim(order, i * chunk, chunk)
    sub = search_thresholds(z[rows], z_max[rows], k[rows], p[rows], thr_k[rows], k_fits[rows])
    # Rows that fit keep the fast result: a row's threshold never depends on its neighbours.
    return thr.at[rows].set(jnp.where(fits[rows], fast[rows], sub))

  n_slow = jnp.sum(~fits)
  return jax.lax.fori_loop(0, (n_slow + chunk - 1) // chunk, body, fast)


def search_thresholds(z: jax.Array, z_max: jax.Array, k: jax.Array, p: jax.Array,
                       thr_k_fast: jax.Array, k_fits: jax.Array) -> jax.Array:
  """Exact top-k / top-p thresholds [B] by a search over the float order of z.

  No sort: each search step is one masked reduction over [B, V]; once a row's
  interval holds at most `_SEARCH_TAIL` tokens they are read out with a
  small top-n and finished exactly. `thr_k_fast` serves rows whose top-k
  fitted the fast path (`k_fits`).
  """
  keys = order_key(z)  # [B, V] i32, monotone in z
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
    tau = take(cand, jnp.clip(k - n_gt_hi - 1, 0, _SEARCH_TAIL - 1))
    return jnp.where(k_fits, thr_k_fast, jnp.where(lo == hi, from_order_key(lo), tau))

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
  tau = jnp.where(n_keep > 0, take(cand, jnp.maximum(n_keep - 1, 0)), from_order_key(hi))
  thr_p = jnp.where(lo == hi, from_order_key(hi), tau)
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
    lo_v, hi_v = from_order_key(lo), from_order_key(hi)
    value_mid = jnp.clip(order_key(lo_v + (hi_v - lo_v) * 0.5), lo + up, hi - 1 + up)
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
  vals, _ = top_n(jnp.where(inside, z, -jnp.inf), _SEARCH_TAIL)
  return vals


def order_key(x: jax.Array) -> jax.Array:
  """int32 keys with the order of float32 x (an involution on the bit pattern)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def from_order_key(key: jax.Array) -> jax.Array:
  """Inverse of `order_key`."""
  bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)
