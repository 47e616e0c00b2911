"""Putting a model on a mesh: params, the KV cache, device state, jitted steps.

`Placement(mesh, model_cfg)` is what `ModelRunner` uses when it runs on more
than one device:
  1. `adapt(params)` repeats KV heads when `tp` exceeds their count (see
     rules.py) and, with `pp` stages, stacks the layers and pads them to a
     multiple of `pp` (pipeline.py); `placement.model_cfg` is the matching
     config.
  2. `place_params(params, dtype)` builds every leaf straight onto its
     `NamedSharding`: from host numpy each device receives only its slice
     (`jax.make_array_from_callback`, also across processes); jax arrays
     already on the mesh (an orbax restore) are resharded device to device.
     No device ever holds a full weight it does not own.
  3. `kv_sharding` places the page pool; `replicate(tree)` the small state.
  4. `jit(fn, state, donate_argnums)` compiles a step: inputs keep the
     shardings they were placed with, the returned state is pinned to the
     same shardings (so donation aliases and nothing recompiles), logits and
     samples come back replicated, and the step is traced under the mesh so
     `head_parallel` / `expert_parallel` can `shard_map` over it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from serving.models.model_config import ModelConfig
from serving.models.quantized import QuantizedWeight, is_quantized
from sharding import pipeline, rules
from sharding.mesh import axis_size

Params = dict[str, Any]


class Placement:
  """Shardings of one model on one mesh (see module doc)."""

  def __init__(self, mesh: jax.sharding.Mesh, model_cfg: ModelConfig):
    self.mesh = mesh
    self.source_cfg = model_cfg
    self.kv_replicas = rules.kv_head_replicas(model_cfg, axis_size(mesh, "tp"))
    self.model_cfg = rules.with_kv_replicas(model_cfg, self.kv_replicas)
    self.replicated = NamedSharding(mesh, P())
    self.stages = pipeline.num_stages(mesh)

  def adapt(self, params: Params) -> Params:
    """Params matching `self.model_cfg` (KV heads repeated if needed).

    Quantized KV weights are not repeated: attention then stays replicated.
    """
    layers = params["layers"]
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    if self.kv_replicas > 1 and not all(isinstance(first[k], (np.ndarray, jax.Array))
                                        for k in ("wk", "wv")):
      self.kv_replicas, self.model_cfg = 1, self.source_cfg
    params = rules.replicate_kv_heads(params, self.source_cfg, self.kv_replicas)[0]
    if self.stages > 1:
      params, self.model_cfg = pipeline.pad_layers(params, self.model_cfg, self.stages)
    return params

  def param_shardings(self, params: Params) -> Params:
    return rules.param_shardings(params, self.model_cfg, self.mesh)

  def place_params(self, params: Params, dtype: Any) -> Params:
    """Every leaf onto its NamedSharding, converted to `dtype` slice by slice.

    A quantized weight's arrays (serving/models/quantized.py: codes, scales)
    keep their dtypes and are split with it (`rules.weight_spec`).
    """
    shardings = self.param_shardings(params)
    quantized = jax.tree.map(is_quantized, params, is_leaf=is_quantized)

    def put(sharding: NamedSharding, is_q: bool, x: Any) -> Any:
      if is_q:
        return jax.tree.map(place, x, sharding)
      return place(x, sharding, dtype)

    return jax.tree.map(put, shardings, quantized, params,
                        is_leaf=lambda s: isinstance(s, (NamedSharding, QuantizedWeight)))

  @property
  def kv_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, rules.kv_cache_spec(self.model_cfg, self.mesh))

  def replicate(self, tree: Any) -> Any:
    """Every leaf replicated over the mesh."""
    return jax.tree.map(lambda x: place(x, self.replicated), tree)

  def replicated_jit(self, fn, *, donate_argnums=()):
    """jit(fn) over a one-axis mesh of the same devices, every input and output replicated.

    The program does not name this mesh's axes, so layouts over the same devices share
    it through the compilation cache (the samplers: tp=2, ep=2 and pp=2 differed only in
    the mesh line of their modules). Arrays replicated on this mesh are accepted as they
    are; the outputs come back on the flat mesh, and `jax.device_put` onto this mesh's
    replicated sharding re-labels them without a copy."""
    flat = NamedSharding(jax.sharding.Mesh(self.mesh.devices.reshape(-1), ("devices",)),
                         jax.sharding.PartitionSpec())
    return jax.jit(fn, donate_argnums=donate_argnums, in_shardings=flat, out_shardings=flat)

  def jit(self, fn, state: Any, *, donate_argnums=()):
    """jit(fn) -> (state, out): state pinned to `state`'s shardings, out replicated."""
    state_shardings = jax.tree.map(lambda a: a.sharding, state)
    return jax.jit(in_mesh(fn, self.mesh), donate_argnums=donate_argnums,
                   out_shardings=(state_shardings, self.replicated))


def place(x: Any, sharding: NamedSharding, dtype: Any = None) -> jax.Array:
  """One array onto `sharding`; host data is sliced per device, never gathered."""
  # A local jax array bound for a mesh spanning processes goes through the host.
  on_device = isinstance(x, jax.Array) and not (
      x.is_fully_addressable and not sharding.is_fully_addressable)
  if on_device:
    if dtype is not None and x.dtype != np.dtype(dtype):
      x = jax.jit(lambda a: a.astype(dtype), out_shardings=sharding)(x)
    return x if x.sharding == sharding else jax.device_put(x, sharding)
  host = np.asarray(x)
  dtype = host.dtype if dtype is None else np.dtype(dtype)
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda idx: np.asarray(host[idx], dtype), dtype=dtype)


def in_mesh(fn, mesh: jax.sharding.Mesh):
  """fn traced with `mesh` as the abstract mesh (what `shard_map` inside reads)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return wrapped
