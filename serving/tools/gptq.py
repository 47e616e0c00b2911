"""Activation-aware int4: GPTQ with input statistics from a calibration text.

GPTQ (Frantar et al., 2022; AutoGPTQ / vLLM's `gptq` format) quantizes a
linear weight column by column, in group order, and spreads each column's
rounding error over the columns not yet quantized through the inverse of
the input second-moment matrix `H = E[x x^T]` of that linear, so the error
of the *output* `x @ w` is minimised rather than the weight's. Our grid is
the same as plain int4 (`checkpoints/quantizers.py`: asymmetric min + scale per group
of 64, fitted by least squares when the group starts), so the result is an
ordinary `QuantizedWeight`; only the codes differ.

Statistics come from running the float model layer by layer over a
calibration text that ships with the package (`calibration_text.py`, not the
quality-test sample), one `decoder_layer` call at a time under jit:

- each linear's inputs are seen through `_Recorder`, a weight wrapper that
  the model's `linear(x, w)` hook calls (`w.matmul(x)`); it adds `x^T x` to
  the layer's statistics and returns the real product;
- `wv` gets the exact Hessian of the attention output instead of `x x^T`:
  value row `s` reaches output `t` with weight `p[t, s]`, so per KV head
  `H_v = sum_{t, query heads} y y^T` with `y_t = sum_s p[t, s] x_s`. This
  matters on SmolLM2: with `x x^T` GPTQ moves error onto the BOS token's
  value, which every head attends to (the attention sink), and KL doubles;
- layers are done in order and layer i+1's statistics are taken on the
  outputs of the already quantized layers 0..i (GPTQ's sequential mode).

Each group's (scale, min) fit weights column j's squared error by its cost
in GPTQ's objective, `1 / U_jj^2` (`U^T U = H^-1`): SmolLM2's massive
activations (one w_down input reaching ~2,800 on BOS) make a few columns
dominate, and an unweighted fit wastes their precision. Small calibration
sets overfit `H` (its rank is at most the token count), so `H` is shrunk
towards its diagonal (`shrink`) and damped (`damp` times its mean
diagonal) before the factorisation. `shrink=1` leaves no error feedback:
importance-weighted rounding, llama.cpp's imatrix idea. docs/quantization.md
has the measured effect of each piece.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import quantizers
from checkpoints.layout import LoadedModel
from serving.models import layers as model_layers
from serving.models import llama
from serving.models import quantized as quant
from serving.models.model_config import ModelConfig
from serving.tools.calibration_text import CALIBRATION_TEXT

# The statistic each linear's input contributes to; weights sharing an input share it.
INPUT_OF = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "wo": "o", "w_gate": "mlp", "w_up": "mlp",
            "w_down": "down"}
DEFAULT_DAMP = 0.1
DEFAULT_SHRINK = 0.3


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Token sequences `[C, T]` (each starting with BOS) of a model with config `cfg`, and
  the GPTQ settings: `damp`, `shrink` (above), `sequential` (statistics on the quantized
  layers' outputs), `weighted` (cost-weighted group fit) and `refine` (its rounds)."""

  cfg: ModelConfig
  sequences: np.ndarray
  damp: float = DEFAULT_DAMP
  shrink: float = DEFAULT_SHRINK
  sequential: bool = True
  weighted: bool = True
  refine: int = 4

  @classmethod
  def from_text(cls, cfg: ModelConfig, tokenizer: Any, text: str | None = None, *,
                seq_len: int = 512, max_sequences: int = 8, **kw) -> Calibration:
    """Splits `text` (default: the shipped `CALIBRATION_TEXT`) into sequences of BOS and
    `seq_len - 1` tokens (at most `max_sequences`; a shorter remainder is dropped)."""
    if text is None:
      text = CALIBRATION_TEXT
    seq_len = min(seq_len, cfg.max_position_embeddings)
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
    n = min(len(ids) // (seq_len - 1), max_sequences)
    if n == 0:
      raise ValueError(f"calibration text has {len(ids)} tokens; need >= {seq_len - 1}")
    body = ids[:n * (seq_len - 1)].reshape(n, seq_len - 1)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else int(body[0, 0])
    return cls(cfg=cfg, sequences=np.concatenate([np.full((n, 1), bos, np.int32), body], 1),
               **kw)


# ---- statistics: one layer at a time under jit ----


class _Recorder:
  """Stands in for a weight in `model_layers.linear`: records `x^T x`, returns `x @ w`."""

  def __init__(self, w: Any, name: str, stats: dict[str, jax.Array]):
    self.w, self.name, self.stats = w, name, stats

  def matmul(self, x: jax.Array) -> jax.Array:
    key = INPUT_OF[self.name]
    if key not in self.stats:
      x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
      self.stats[key] = x2.T @ x2
    if self.name == "wv":
      self.stats["_v_in"] = x
    return model_layers.linear(x, self.w)


def _dense_attend(cfg: ModelConfig, stats: dict[str, jax.Array] | None, layer, q, k, v, kv):
  """Causal attention over one sequence; adds the value Hessians per KV head to `stats`."""
  t, n, h = q.shape
  kh = k.shape[1]
  # [T, N, H] -> [T, K, G, H]
  qg = q.reshape(t, kh, n // kh, h).astype(jnp.float32)
  s = jnp.einsum("tkgh,skh->kgts", qg, k.astype(jnp.float32)) * h ** -0.5
  pos = jnp.arange(t)
  mask = pos[None, :] <= pos[:, None]
  if cfg.sliding_window:
    mask &= pos[None, :] > pos[:, None] - cfg.sliding_window
  p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)  # [K, G, T, S]
  out = jnp.einsum("kgts,skh->tkgh", p, v.astype(jnp.float32)).reshape(t, n, h)
  if stats is not None:
    x = stats.pop("_v_in").astype(jnp.float32)  # wv's input [S, D]
    y = jnp.einsum("kgts,sd->kgtd", p, x)
    stats["v"] = jnp.einsum("kgtd,kgte->kde", y, y)  # [K, D, D]
  return out.astype(q.dtype), kv


@functools.partial(jax.jit, static_argnames=("cfg", "collect"))
def _layer(lp, h, *, cfg: ModelConfig, collect: bool):
  """One layer over one sequence h [T, D] -> (h, {statistic: sum}) (stats if `collect`)."""
  stats: dict[str, jax.Array] = {}
  if collect:
    lp = {k: _Recorder(w, k, stats) if k in INPUT_OF else w for k, w in lp.items()}
  positions = jnp.arange(h.shape[0], dtype=jnp.int32)
  inv_freq = jnp.asarray(model_layers.rope_inv_freq(cfg))
  attend = functools.partial(_dense_attend, cfg, stats if collect else None)
  h, _ = llama.decoder_layer(cfg, lp, h, positions, inv_freq, jnp.int32(0), None, attend)
  return h, stats


@functools.partial(jax.jit, static_argnames=("act_dtype",))
def _embed(embed, tokens, *, act_dtype):
  return model_layers.embed_tokens(embed, tokens).astype(act_dtype)


# ---- GPTQ ----


def hessian_inverse_factor(hess: np.ndarray, damp: float, shrink: float
                           ) -> tuple[np.ndarray, np.ndarray]:
  """Upper triangular U with U^T U = H^-1, after shrinkage and damping; and the dead inputs.

  `hess` [..., I, I] -> (U float32 [..., I, I], dead bool [..., I]).
  """
  hess = np.asarray(hess, np.float64)
  diag = np.diagonal(hess, axis1=-2, axis2=-1)
  eye = np.eye(hess.shape[-1])
  hess = (1 - shrink) * hess + shrink * diag[..., None] * eye
  dead = diag <= 0
  hess = hess + dead[..., None] * eye  # inputs never seen: H_ii = 1, weights zeroed
  mean = np.mean(np.where(dead, 0, diag), axis=-1)[..., None, None]
  hess = hess + damp * np.maximum(mean, 1e-12) * eye
  return np.asarray(_upper_inverse_factor(hess.astype(np.float32))), dead


@jax.jit
def _upper_inverse_factor(hess):
  """U = R^-1 where H = R R^T, R upper: the Cholesky factor of H with rows and columns
  reversed. Then H^-1 = R^-T R^-1 = U^T U (no explicit inverse is formed)."""
  r = jnp.flip(jnp.linalg.cholesky(jnp.flip(hess, (-2, -1))), (-2, -1))
  eye = jnp.broadcast_to(jnp.eye(hess.shape[-1], dtype=hess.dtype), hess.shape)
  return jax.scipy.linalg.solve_triangular(r, eye, lower=False)


@functools.partial(jax.jit, static_argnames=("group_size", "refine", "weighted"))
def _gptq_rows(w, hinv, *, group_size: int, refine: int, weighted: bool):
  """GPTQ of rows w [O, I] (float32) with U = chol(H^-1)^T -> codes, scale, offset.

  Groups are quantized in order; inside a group, column by column with the
  error fed forward through U's row; after a group, the group's errors
  update every later column at once (GPTQ's lazy batch, block = group).
  """
  o, i = w.shape
  g = group_size

  def group(gi, carry):
    w, codes, scale, offset = carry
    start = gi * g
    wb = jax.lax.dynamic_slice_in_dim(w, start, g, axis=1)  # [O, g]
    ub = jax.lax.dynamic_slice(hinv, (start, start), (g, g))  # upper triangular
    # Column j's rounding error costs e^2 / U_jj^2 in GPTQ's objective: fit the grid so.
    cost = 1.0 / jnp.square(jnp.diagonal(ub)) if weighted else None
    s16, o16 = quantizers.fit_min_scale(wb[:, None, :], refine, xp=jnp, weights=cost)  # [O, 1]
    s, off = s16[:, 0].astype(jnp.float32), o16[:, 0].astype(jnp.float32)
    safe = jnp.where(s == 0, 1, s)

    def column(j, c):
      wb, cb, eb = c
      x = wb[:, j]
      q = jnp.clip(jnp.rint((x - off) / safe), 0, 15)
      e = (x - (q * s + off)) / ub[j, j]
      wb = wb - e[:, None] * ub[j][None, :]  # U[j, :j] = 0: only columns >= j move
      return wb, cb.at[:, j].set(q), eb.at[:, j].set(e)

    zeros = jnp.zeros((o, g), jnp.float32)
    _, cb, eb = jax.lax.fori_loop(0, g, column, (wb, zeros, zeros))
    w = w - eb @ jax.lax.dynamic_slice_in_dim(hinv, start, g, axis=0)  # later columns
    codes = jax.lax.dynamic_update_slice_in_dim(codes, cb.astype(jnp.uint8), start, axis=1)
    return w, codes, scale.at[:, gi].set(s16[:, 0]), offset.at[:, gi].set(o16[:, 0])

  init = (w, jnp.zeros((o, i), jnp.uint8), jnp.zeros((o, i // g), jnp.float16),
          jnp.zeros((o, i // g), jnp.float16))
  _, codes, scale, offset = jax.lax.fori_loop(0, i // g, group, init)
  return codes, scale, offset


def gptq_int4(w: np.ndarray, hess: np.ndarray, group_size: int = quant.DEFAULT_INT4_GROUP, *,
              damp: float = DEFAULT_DAMP, shrink: float = DEFAULT_SHRINK, refine: int = 2,
              weighted: bool = True, transpose: bool = True) -> quant.QuantizedWeight:
  """GPTQ int4 (min + scale per group) of one `[In, Out]` weight for inputs with `E[x x^T] = hess`.

  `hess` is `[In, In]`, or `[B, In, In]` for `B` equal blocks of output rows
  (per-KV-head value Hessians). `transpose=False`: `w` is already `[Out, In]`.
  """
  rows = quantizers.weight_rows(w, transpose)
  hinv, dead = hessian_inverse_factor(hess, damp, shrink)
  blocks = hinv.shape[0] if hinv.ndim == 3 else 1
  out_dim, in_dim = rows.shape
  r = rows.reshape(blocks, out_dim // blocks, in_dim)
  dead = dead.reshape(blocks, 1, in_dim)
  r = np.where(dead, 0, r)
  fn = functools.partial(_gptq_rows, group_size=group_size, refine=refine, weighted=weighted)
  codes, scale, offset = jax.vmap(fn)(r, hinv.reshape(blocks, in_dim, in_dim))
  codes, scale, offset = (np.asarray(a).reshape(out_dim, -1) for a in (codes, scale, offset))
  return quant.QuantizedWeight(q=quantizers.pack_int4(codes, group_size), scale=scale,
                               offset=offset, kind="int4", group_size=group_size)


# ---- the whole model ----


def _layer_params(layers, i: int) -> dict[str, Any]:
  if isinstance(layers, dict):
    return {k: (v[i] if quant.is_quantized(v) else np.asarray(v[i])) for k, v in layers.items()}
  return dict(layers[i])


def gptq_quantize_layers(params: dict, calibration: Calibration,
                         group_size: int = quant.DEFAULT_INT4_GROUP) -> dict:
  """Params with every float dense linear layer weight GPTQ-quantized to int4 (see module doc).

  Leaves that are already quantized (GGUF blocks) are kept; the embedding,
  head, norms and MoE experts are left to `quantizers.quantize_params`.
  """
  cfg, seqs = calibration.cfg, np.asarray(calibration.sequences, np.int32)
  layers = params["layers"]
  per_layer = [layers] if isinstance(layers, dict) else layers
  if all(quant.is_quantized(lp[k]) for lp in per_layer for k in INPUT_OF if k in lp):
    return params  # nothing in float (e.g. GGUF blocks kept): skip the calibration pass
  h = [_embed(params["embed"], s, act_dtype=jnp.float32) for s in seqs]
  out_layers = []
  for i in range(cfg.num_layers):
    lp = _layer_params(layers, i)
    todo = [k for k in INPUT_OF if k in lp and not quant.is_quantized(lp[k])]
    if not todo:
      out_layers.append(lp)
      h = [_layer(lp, x, cfg=cfg, collect=False)[0] for x in h]
      continue
    stats: dict[str, np.ndarray] = {}
    float_out = []
    for x in h:
      y, st = _layer(lp, x, cfg=cfg, collect=True)
      float_out.append(y)
      for k, v in st.items():
        stats[k] = stats.get(k, 0) + np.asarray(v, np.float64)
    qlp = dict(lp)
    # Weights with the same statistic are quantized as one matrix (rows concatenated).
    for stat in dict.fromkeys("v" if k == "wv" else INPUT_OF[k] for k in todo):
      keys = [k for k in todo if ("v" if k == "wv" else INPUT_OF[k]) == stat]
      rows = np.concatenate([np.asarray(lp[k], np.float32).T for k in keys])  # [sum O, I]
      qw = gptq_int4(rows, stats[stat] / seqs.size, quantizers.fit_group(rows.shape[1], group_size),
                     damp=calibration.damp, shrink=calibration.shrink,
                     refine=calibration.refine, weighted=calibration.weighted, transpose=False)
      start = 0
      for k in keys:
        o = np.shape(lp[k])[1]
        qlp[k] = jax.tree.map(lambda a, s=start, o=o: a[s:s + o], qw)
        start += o
    out_layers.append(qlp)
    if calibration.sequential:
      h = [_layer(qlp, x, cfg=cfg, collect=False)[0] for x in h]
    else:
      h = float_out
  if isinstance(layers, dict):
    out_layers = _stack_layers(out_layers)
  return {**params, "layers": out_layers}


def _stack_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
  """Per-layer dicts -> {name: [L, ...]} (QuantizedWeight leaves stacked field by field)."""
  def stack(*xs):
    return np.stack([np.asarray(x) for x in xs])

  return {k: jax.tree.map(stack, *[lp[k] for lp in layers]) for k in layers[0]}


def gptq_quantize_params(params: dict, calibration: Calibration,
                         group_size: int | None = None) -> dict:
  """A params tree quantized to int4: float linear layers by GPTQ, then the head and
  anything left as `quantizers.quantize_params` does (quantized leaves are kept)."""
  params = gptq_quantize_layers(params, calibration, group_size or quant.DEFAULT_INT4_GROUP)
  return quantizers.quantize_params(params, "int4", group_size=group_size)


def calibrated_int4(loaded: LoadedModel, group_size: int | None = None) -> dict:
  """`loaded.params` quantized to int4 for storage, by GPTQ on the shipped calibration text."""
  calibration = Calibration.from_text(loaded.config, loaded.tokenizer)
  return gptq_quantize_params(loaded.params, calibration, group_size)
