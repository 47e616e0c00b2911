"""Qwen3-Next HF safetensors -> params (serving/models/qwen3_next.py's block layout).

A block gathers several HF layers, so one tensor fills a slice of a params leaf
(`qwen3_next.hf_tensors` says which); every slice is tracked, and a tensor that is
missing, unknown or of the wrong shape raises ValueError naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints.layout import Params, resolve_dtype
from serving.models import qwen3_next
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig

# Leading axes a tensor's slice indexes, per params key prefix: (block, sub-layer[, expert]).
_INDEX_DIMS = {"sub_we_": 3, "sub_": 2, "lin_": 2}


def load_params(files: Any, cfg: ModelConfig, dtype: Any = np.float32) -> Params:
  """`files`: (name, read) pairs (checkpoints/hf.py `iter_safetensors`) -> params."""
  dt = resolve_dtype(dtype)
  shapes = param_shapes(cfg)
  params: Params = {k: np.empty(s, dt) for k, s in shapes.items() if k != "layers"}
  params["layers"] = {k: np.empty(s, dt) for k, s in shapes["layers"].items()}
  if cfg.tie_word_embeddings:
    params.pop("lm_head", None)
  # Which slices of each leaf a tensor has written: () for a top-level leaf, (G,) or
  # (G, J[, E]) for a layer leaf (`_INDEX_DIMS`).
  filled = {k: np.zeros((), bool) for k in params if k != "layers"}
  filled.update({k: np.zeros(s[:_index_dims(k)], bool) for k, s in shapes["layers"].items()})
  for name, read in files:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    if name.endswith("rotary_emb.inv_freq"):
      continue
    for key, index, value in qwen3_next.hf_tensors(cfg, name, read()):
      leaf = params[key] if key in params else params["layers"].get(key)
      if leaf is None:
        raise ValueError(f"checkpoint tensor {name!r} maps to {key!r}, which this config "
                         "does not have")
      if tuple(value.shape) != leaf[index].shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                         f"expected {leaf[index].shape} for {key!r}")
      leaf[index] = value
      filled[key][index] = True  # a fused experts tensor fills (block, sub-layer, every expert)
  missing = sorted(k for k, f in filled.items() if not f.all())
  if missing:
    raise ValueError(f"qwen3_next checkpoint is missing tensors for {missing}")
  return params


def _index_dims(key: str) -> int:
  """Leading axes of layer leaf `key` that one checkpoint tensor indexes."""
  return next((n for p, n in _INDEX_DIMS.items() if key.startswith(p)), 1)
