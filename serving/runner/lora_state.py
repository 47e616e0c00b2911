"""The LoRA slots on the device: their layout, their contents, and the slot write.

With `max_loras = S > 0` the runner holds, for every module an adapter may
target (`serving.models.lora.lora_targets`) and every layer, `a [In, S, R]`
and `b [S, R, Out]` with `R = max_lora_rank`, laid out like the params'
`layers` (a list of per-layer dicts when layers are unrolled, one dict of
`[L, ...]` stacks when scanned), all zero at start. `slot_contents` turns a
validated adapter (checkpoints.lora.LoraWeights) into one slot's worth of
host arrays — rank zero-padded to R, modules it does not target zero, KV
columns repeated like the base weights when tp repeats KV heads — and
`write_slot` puts them into slot s: the same shapes every time, so loading
and evicting adapters never recompiles anything.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from checkpoints.lora import LoraWeights, module_dims
from serving.models.lora import lora_targets
from serving.models.model_config import ModelConfig
from sharding.rules import repeat_kv_heads

Lora = Any  # list[dict[key, (a, b)]] or dict[key, (a [L, ...], b [L, ...])]


def lora_shapes(cfg: ModelConfig, num_slots: int, rank: int,
                unrolled: bool) -> Lora:
  """Shapes of the slot arrays (see module doc), per-layer or stacked."""
  dims = {k: v for k, v in module_dims(cfg).items() if k in lora_targets(cfg.is_moe)}
  if unrolled:
    return [{k: ((i, num_slots, rank), (num_slots, rank, o)) for k, (i, o) in dims.items()}
            for _ in range(cfg.num_layers)]
  n = cfg.num_layers
  return {k: ((n, i, num_slots, rank), (n, num_slots, rank, o)) for k, (i, o) in dims.items()}


def lora_zeros(cfg: ModelConfig, num_slots: int, rank: int, unrolled: bool,
               dtype: Any) -> Lora:
  """Host zeros of every slot (see `lora_shapes`)."""
  def zeros(pair):
    return tuple(np.zeros(shape, dtype) for shape in pair)

  shapes = lora_shapes(cfg, num_slots, rank, unrolled)
  if unrolled:
    return [{k: zeros(v) for k, v in lp.items()} for lp in shapes]
  return {k: zeros(v) for k, v in shapes.items()}


def slot_contents(weights: LoraWeights | None, cfg: ModelConfig, rank: int, unrolled: bool,
                  dtype: Any, kv_replicas: int = 1) -> Lora:
  """One slot's arrays for `weights` (None: all zero), shaped like `lora_shapes` without
  the slot axis. `cfg` is the source model's (before KV heads are repeated)."""
  dims = {k: v for k, v in module_dims(cfg).items() if k in lora_targets(cfg.is_moe)}
  if weights is not None and weights.rank > rank:
    raise ValueError(f"adapter rank {weights.rank} exceeds the slots' rank {rank}")
  layers = []
  for layer in range(cfg.num_layers):
    mods = weights.layers.get(layer, {}) if weights is not None else {}
    out = {}
    for key, (d_in, d_out) in dims.items():
      a, b = np.zeros((d_in, rank), dtype), np.zeros((rank, d_out), dtype)
      if key in mods:
        wa, wb = mods[key]
        a[:, :wa.shape[1]], b[:wb.shape[0]] = wa, wb
      if key in ("wk", "wv"):
        b = repeat_kv_heads(b, cfg.head_dim, kv_replicas)
      out[key] = (a, b)
    layers.append(out)
  if unrolled:
    return layers
  return {k: tuple(np.stack([lp[k][j] for lp in layers]) for j in range(2)) for k in dims}


def write_slot(lora: Lora, slot: jnp.ndarray, contents: Lora) -> Lora:
  """Pure: `lora` with slot `slot` replaced by `contents` (jitted, donated, by the runner)."""
  # The slot axis: a [..., In, S, R] -> -2; b [..., S, R, Out] -> -3.
  def put(x, c, slot_axis):
    index = [slice(None)] * x.ndim
    index[x.ndim + slot_axis] = slot
    return x.at[tuple(index)].set(c)

  def module(pair, new):
    return put(pair[0], new[0], -2), put(pair[1], new[1], -3)

  if isinstance(lora, (list, tuple)):
    return [{k: module(lp[k], cp[k]) for k in lp} for lp, cp in zip(lora, contents, strict=True)]
  return {k: module(lora[k], contents[k]) for k in lora}
