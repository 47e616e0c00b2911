"""Pipeline parallelism: the decoder layers split into `pp` stages of consecutive layers.

Layout (rules.py): the stacked layer weights `[L, ...]` and the KV page pool
`[L*P, ...]` are split along their layer axis over the mesh's `pp` axis, so
stage s holds layers `[s*L/pp, (s+1)*L/pp)` and those layers' pages, and no
other weight of the stack. The embedding, final norm and LM head stay outside
the stages (replicated over `pp`, split over `tp` as without pipelining).
When `pp` does not divide L, `pad_layers` appends zero layers: a pre-norm
layer with all-zero weights adds exactly zero to the residual stream (its
attention output and MLP output are products with zero matrices), so the
padded model computes the same function; their KV pages cost L_pad / L of
the pool.

Schedule (GPipe fill and drain, inside one jitted step): `pipeline_layers`
is a `shard_map` manual over `pp` only — `tp` and `ep` stay automatic inside
it, so pp composes with tensor and expert parallelism. A step's rows are cut
into M microbatches (M = pp when the row count divides). Decode and verify
rows are independent; a prefill step's rows are its chunks' tokens packed
back to back, so a chunk may straddle two microbatches: each microbatch
writes its own rows' K/V and its attention runs over the whole step's chunk
metadata with the other rows' queries zero (steps.attend_fn's `window`), so
a row reads the K/V that rows before it wrote on the same stage one tick
earlier — causal order holds because every stage runs microbatch m before
m + 1. That repeats the prefill attention M times (the projections and MLP,
most of the work, are not repeated). At
tick t stage s runs microbatch t - s through its layers, then hands the
activation to stage s + 1 with one collective permute; with M >= 2 every
stage works on a different microbatch in the same tick, and only the
(pp - 1) fill and drain ticks of M + pp - 1 leave a stage idle. An idle tick
computes on stale data with its KV writes sent to the dummy page (the
`stage_fn`'s `active` flag), so it changes no state. After the last tick the
last stage's outputs are summed over `pp` (the other stages contribute
zeros): one all-reduce of `[T, D]` activations per step, never of weights.
The shard_map runs with `check_vma=False`: the layers' own loops (attention,
scan) would otherwise need every carry cast to "varying over pp".

With several processes the same program runs multi-controller: one stage per
process, the permutes go over the process boundary (gloo on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from serving.models.model_config import ModelConfig
from sharding.mesh import axis_size

# stage_fn(layers, x [T', D], rows, shared, kv, active, start) -> (x, kv): the stage's
# layers over one microbatch, rows [start, start + T') of the step; `active` (a traced
# bool, or True) is False on idle ticks.
StageFn = Callable[..., tuple[jax.Array, Any]]

def num_stages(mesh) -> int:
  """Pipeline stages of a mesh (1 without a `pp` axis, or outside any mesh)."""
  return 1 if mesh is None or mesh.empty else axis_size(mesh, "pp")


def stack_layers(layers: list[dict]) -> dict:
  """Per-layer dicts -> one dict of stacked `[L, ...]` leaves (every layer alike)."""
  first = jax.tree.structure(layers[0])
  for i, lp in enumerate(layers):
    if jax.tree.structure(lp) != first or any(
        np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(lp),
                                                   jax.tree.leaves(layers[0]), strict=True)):
      raise ValueError(f"pipeline stages need every layer in one weight format, but layer {i} "
                       "differs from layer 0 (a checkpoint mixing formats across layers); "
                       "pass a --weight_dtype or --quantization that gives one")
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)


def pad_layers(params: dict, cfg: ModelConfig, stages: int) -> tuple[dict, ModelConfig]:
  """Params with stacked layers, zero-padded to a multiple of `stages` -> (params, cfg with
  the padded layer count). Zero layers are identities (module doc)."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    layers = stack_layers(list(layers))
  total = -(-cfg.num_layers // stages) * stages
  extra = total - cfg.num_layers
  if extra:
    def pad(a):
      xp = jnp if isinstance(a, jax.Array) else np
      return xp.concatenate([a, xp.zeros((extra, *a.shape[1:]), a.dtype)])

    layers = jax.tree.map(pad, layers)
  types = cfg.layer_types + ("full_attention",) * extra if cfg.layer_types else ()
  return {**params, "layers": layers}, dataclasses.replace(cfg, num_layers=total,
                                                           layer_types=types)


def layer_offset(layers: Any) -> int | jax.Array:
  """The global id of a stage's first layer: 0 without stages; inside
  `pipeline_layers`' shard_map, the stage index times its layer count (traced)."""
  mesh = jax.sharding.get_abstract_mesh()
  if num_stages(mesh) == 1:
    return 0
  per_stage = len(layers) if isinstance(layers, (list, tuple)) else (
      jax.tree.leaves(layers)[0].shape[0])
  return jax.lax.axis_index("pp") * per_stage


def microbatches(rows: int, stages: int) -> int:
  """M for a step of `rows` rows: `stages` when the rows cut evenly, else 1."""
  return stages if stages > 1 and rows % stages == 0 else 1


def pipeline_layers(stage_fn: StageFn, layers: Any, x: jax.Array, rows: Any, shared: Any,
                    kv: Any) -> tuple[jax.Array, Any]:
  """The decoder stack over x [T, D], pipelined over the tracing mesh's `pp` stages.

  `rows`: per-row step inputs (positions, KV indices, ...), every leaf with the
  step's rows leading (T tokens, or the B sequences of a verify step whose T is
  B*S, row-major); microbatch m gets the m-th of M equal slices of each. `shared`: inputs
  every microbatch sees whole (a prefill step's chunk metadata). Without
  stages it is `stage_fn` over the whole step.
  """
  mesh = jax.sharding.get_abstract_mesh()
  stages = num_stages(mesh)
  if stages == 1:
    return stage_fn(layers, x, rows, shared, kv, True, 0)
  m = min(microbatches(n, stages) for n in [x.shape[0], *(a.shape[0] for a in
                                                         jax.tree.leaves(rows))])
  size = x.shape[0] // m
  staged = lambda tree: jax.tree.map(lambda _: P("pp"), tree)  # noqa: E731

  def stage(layers, x, rows, shared, kv):
    s = jax.lax.axis_index("pp")
    xs = x.reshape(m, size, *x.shape[1:])
    cut = jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), rows)
    carry = jnp.zeros_like(xs[0])
    out = jnp.zeros_like(xs)
    for tick in range(m + stages - 1):
      mb = tick - s
      active = (mb >= 0) & (mb < m)
      i = jnp.clip(mb, 0, m - 1)
      y, kv = stage_fn(layers, jnp.where(s == 0, xs[min(tick, m - 1)], carry),
                       jax.tree.map(lambda a, i=i: a[i], cut), shared, kv, active, i * size)
      out = jnp.where(active & (s == stages - 1), out.at[i].set(y), out)
      if tick < m + stages - 2:
        carry = jax.lax.ppermute(y, "pp", [(j, j + 1) for j in range(stages - 1)])
    last = jnp.where(s == stages - 1, out, jnp.zeros_like(out))
    return jax.lax.psum(last, "pp").reshape(x.shape), kv

  return jax.shard_map(stage, mesh=mesh, in_specs=(staged(layers), P(), P(), P(), staged(kv)),
                       out_specs=(P(), staged(kv)), axis_names={"pp"},
                       check_vma=False)(layers, x, rows, shared, kv)
