"""Sharded checkpoints: orbax save from a mesh, restore straight onto another.

`save_sharded` writes params that live on a mesh (each process writes the
shards it holds; with several processes every one of them must call it).
`restore_sharded(path, mesh)` builds the abstract tree of
`jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(...))` from the
checkpoint's config and the rule table, so orbax reads into every device
only the slice it owns: the full weights never exist on one host or device.
The layouts need not match: a checkpoint saved at tp=2 restores at tp=4.

Params are saved in the source layout of docs/structure.md (stacked
`[L, ...]`, K KV heads); `ModelRunner` repeats KV heads after the restore
when tp exceeds K, so those few matrices restore replicated.

Hugging Face safetensors (checkpoints/hf.py) stream tensor by tensor into
host numpy (peak host memory: the params plus one tensor); the runner then
hands each device only its slice (`sharding.placement.place`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints.layout import LoadedModel
from checkpoints.orbax_io import MARKER_FILE, config_from_dict, load_orbax, save_orbax
from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig
from sharding import rules
from sharding.placement import Placement

Params = dict[str, Any]
_KV_KEYS = ("wk", "wv", "bk", "bv")


def save_sharded(params: Params, cfg: ModelConfig, out_dir: str, tokenizer=None,
                 source: str = "") -> str:
  """Writes stacked params (numpy or jax arrays on any mesh) as an orbax checkpoint."""
  if isinstance(params.get("layers"), (list, tuple)):
    raise ValueError("save_sharded needs stacked [L, ...] layers (docs/structure.md); got the "
                     "per-layer list form (run the runner with unroll_layers=False, or save "
                     "the loader's params)")
  return save_orbax(LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=source),
                    out_dir)


def restore_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Params:
  """NamedShardings for a stacked params tree of `cfg`, as the runner will use them."""
  placement = Placement(mesh, cfg)
  specs = rules.param_specs(param_shapes(cfg), placement.model_cfg, mesh)
  if placement.kv_replicas > 1:  # the checkpoint holds K < tp KV heads: restore replicated
    for key in _KV_KEYS:
      if key in specs["layers"]:
        specs["layers"][key] = P()
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def restore_sharded(path: str, mesh: jax.sharding.Mesh, dtype: Any = None) -> LoadedModel:
  """Restores a `save_orbax` / `save_sharded` directory straight onto `mesh`."""
  with open(os.path.join(path, MARKER_FILE), encoding="utf-8") as f:
    meta = json.load(f)
  if meta.get("quantization"):
    raise ValueError(f"{path} holds quantized weights: restore it with load_orbax (on the "
                     "host) and let the runner place it; its codes and scales are sliced per "
                     "device like float weights (docs/quantization.md)")
  cfg = config_from_dict(meta["config"])
  return load_orbax(path, dtype=dtype, shardings=restore_shardings(cfg, mesh))
