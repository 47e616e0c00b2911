"""Meshes, logical-axis rules, partition specs and multi-host start-up.

- `mesh.py`: `ParallelConfig(tp, ep, dp, pp)` -> a `(dp, pp, ep, tp)` jax Mesh.
- `rules.py`: the one logical-axis -> mesh-axis table, params / KV specs,
  KV-head replication when `tp` exceeds the KV head count.
- `placement.py`: `Placement`, what `ModelRunner` uses to put params, the
  KV cache and its jitted steps on a mesh.
- `distributed.py`: `jax.distributed` start-up from flags or the environment.
- `pipeline.py`: `pipeline_layers`, the layer stack over `pp` stages with
  microbatches in flight; `pad_layers` for layer counts pp does not divide.
- `attention.py`: `head_parallel`, attention kernels run per head shard.
- `experts.py`: `expert_parallel`, MoE experts run per expert shard.

Reading checkpoints straight onto a mesh lives in `checkpoints/` (sharded.py,
hf_sharded.py), which builds on this package.

See docs/sharding.md.
"""

from sharding.attention import head_parallel
from sharding.experts import expert_parallel
from sharding.mesh import AXES, ParallelConfig, make_mesh, mesh_for
from sharding.pipeline import layer_offset, pipeline_layers
from sharding.placement import Placement
from sharding.rules import LOGICAL_AXIS_RULES, PARAM_AXES, param_specs

__all__ = ["AXES", "LOGICAL_AXIS_RULES", "PARAM_AXES", "ParallelConfig", "Placement",
           "expert_parallel", "head_parallel", "make_mesh", "mesh_for", "param_specs",
           "pipeline_layers", "layer_offset"]
