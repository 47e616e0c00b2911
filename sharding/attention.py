"""Head-parallel attention: the per-layer attend callback as a `shard_map` over heads.

GSPMD partitions the XLA attention path by itself (the KV cache and the
query heads are split over `tp` alike). A Pallas kernel is an opaque custom
call to the partitioner, which would gather its operands (the whole KV
cache) onto every device. `head_parallel(attend, cfg)` runs the callback
`attend(layer, q[T,N,H], k[T,K,H], v[T,K,H], kv, sinks=[N] | None) -> (out[T,N,H], kv)`
once
per shard instead: every device sees its own query heads, KV heads and
cache pages, so kernels need no knowledge of the mesh and no collective
runs. Whole GQA groups stay on one device because the rules split heads
only when both N and K divide (rules.resolve_rules).

Wire it where the runner builds the callback (`attend =
sharding.attention.head_parallel(attend, cfg)`); outside a mesh, or when
heads are replicated, it returns the callback unchanged at trace time.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from serving.models.model_config import ModelConfig
from sharding import rules


def head_parallel(attend, cfg: ModelConfig):
  """`attend` run per head shard under the tracing mesh (see module doc)."""

  def wrapped(layer, q, k, v, kv, sinks=None):
    mesh = jax.sharding.get_abstract_mesh()
    axis = None if mesh.empty else rules.resolve_rules(cfg, mesh)["kv_heads"]
    if axis is None:
      return attend(layer, q, k, v, kv, sinks=sinks)
    heads = P(None, axis, None)  # [T, heads, H]
    cache = rules.logical_spec(rules.KV_CACHE_AXES, {**dict.fromkeys(rules.KV_CACHE_AXES),
                                                     "kv_heads": axis})
    kv_specs = dataclasses.replace(kv, k=cache, v=cache)
    sink_spec = None if sinks is None else P(axis)  # [N]: the shard's query heads

    def local(q, k, v, kv, sinks):  # a Python-int layer id stays static (per-layer settings)
      return attend(layer, q, k, v, kv, sinks=sinks)

    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, kv_specs, sink_spec),
                         out_specs=(heads, kv_specs), check_vma=False)(q, k, v, kv, sinks)

  return wrapped
