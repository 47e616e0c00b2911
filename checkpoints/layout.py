"""A filler loaders share, and LoadedModel, what every loader returns.

`serving.models.layout.param_shapes(config)` gives the shape of every leaf
of the params pytree (docs/structure.md), so a loader can allocate the
stacked `[L, ...]` arrays up front and copy each checkpoint
tensor into its slot as it streams by: host memory stays at the final params
plus one source tensor. `ParamsBuilder` does that bookkeeping and refuses to
finish while any slot is unfilled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from checkpoints.tokenizer import Tokenizer
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig

Params = dict[str, Any]

_DTYPES = {
    "float32": np.dtype(np.float32),
    "fp32": np.dtype(np.float32),
    "f32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}


def resolve_dtype(dtype: Any) -> np.dtype:
  """np.float32 or ml_dtypes.bfloat16 (also by name); anything else raises."""
  if isinstance(dtype, str):
    key = dtype.lower()
    if key not in _DTYPES:
      raise ValueError(f"unsupported params dtype {dtype!r} (supported: float32, bfloat16)")
    return _DTYPES[key]
  dt = np.dtype(dtype)
  if dt not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"unsupported params dtype {dt} (supported: float32, bfloat16)")
  return dt


class ParamsBuilder:
  """Preallocated params; `put` copies one (layer, expert) slice at a time.

  `absent`: layer keys neither allocated nor expected (a loader that keeps them
  quantized adds them after `finish`, e.g. MXFP4 experts).
  """

  def __init__(self, cfg: ModelConfig, dtype: Any = np.float32,
               absent: frozenset[str] = frozenset()):
    self.cfg = cfg
    self.dtype = resolve_dtype(dtype)
    shapes = param_shapes(cfg)
    self.params: Params = {k: np.empty(s, self.dtype) for k, s in shapes.items() if k != "layers"}
    self.params["layers"] = {k: np.empty(s, self.dtype) for k, s in shapes["layers"].items()
                             if k not in absent}
    # Slots still to fill: (key, layer, expert); None where the axis is absent.
    self._todo: set[tuple[str, int | None, int | None]] = set()
    for key in self.params:
      if key != "layers":
        self._todo.add((key, None, None))
    for key in self.params["layers"]:
      experts = range(cfg.num_experts) if key.startswith("we_") else [None]
      self._todo.update((key, i, e) for i in range(cfg.num_layers) for e in experts)

  def has(self, key: str) -> bool:
    return key in self.params or key in self.params["layers"]

  def put(self, key: str, value: np.ndarray, layer: int | None = None,
          expert: int | None = None, source: str = "") -> None:
    """Copies `value` into params[key][layer][expert] (checking the shape)."""
    if layer is None:
      dst = self.params.get(key)
    else:
      dst = self.params["layers"].get(key)
    if dst is None:
      raise ValueError(f"checkpoint tensor {source or key!r} maps to {key!r}, which this "
                       f"{self.cfg.model_type} config does not have")
    if layer is not None:
      if not 0 <= layer < self.cfg.num_layers:
        raise ValueError(f"{source!r}: layer {layer} out of range (num_layers="
                         f"{self.cfg.num_layers})")
      dst = dst[layer]
      if expert is not None:
        if not 0 <= expert < self.cfg.num_experts:
          raise ValueError(f"{source!r}: expert {expert} out of range")
        dst = dst[expert]
    if tuple(value.shape) != dst.shape:
      raise ValueError(f"checkpoint tensor {source or key!r} has shape {tuple(value.shape)}, "
                       f"expected {dst.shape} for {key!r}")
    dst[...] = value
    if expert is None and key.startswith("we_"):
      self._todo.difference_update((key, layer, e) for e in range(self.cfg.num_experts))
    else:
      self._todo.discard((key, layer, expert))

  def skip(self, key: str, layer: int | None = None) -> None:
    """Marks params[key][layer] (every expert) as served from elsewhere: left unwritten
    (e.g. GGUF blocks kept quantized replace it), and not missing at `finish`."""
    self._todo = {t for t in self._todo if not (t[0] == key and t[1] == layer)}

  def finish(self) -> Params:
    """The params; raises if any slot was never written."""
    if self._todo:
      missing = sorted(self._todo, key=lambda t: (t[0], t[1] or 0, t[2] or 0))[:8]
      raise ValueError(f"checkpoint is missing {len(self._todo)} tensors, e.g. "
                       + ", ".join(_slot_name(*m) for m in missing))
    return self.params


def _slot_name(key: str, layer: int | None, expert: int | None) -> str:
  name = key if layer is None else f"layers.{key}[{layer}]"
  return name if expert is None else f"{name}[expert {expert}]"


def merge_eos(config: ModelConfig, tokenizer: Tokenizer | None) -> ModelConfig:
  """config.eos_token_ids followed by the tokenizer's other end-of-generation ids."""
  if tokenizer is None:
    return config
  extra = sorted(set(tokenizer.eos_token_ids) - set(config.eos_token_ids))
  return dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, *extra))


@dataclasses.dataclass
class LoadedModel:
  """What every loader returns.

  `params` follows docs/structure.md (numpy arrays, or jax arrays when an
  orbax checkpoint is restored onto shardings); `tokenizer` is None only for
  a HF directory without tokenizer files; `source` is the resolved path.
  `config.eos_token_ids` already includes the tokenizer's end-of-generation ids.
  """

  config: ModelConfig
  params: Params
  tokenizer: Tokenizer | None
  source: str
