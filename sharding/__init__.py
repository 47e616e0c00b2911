"""Meshes, logical-axis rules, partition specs and multi-host start-up.

- `mesh.py`: `ParallelConfig(tp, ep, dp)` -> a `(dp, ep, tp)` jax Mesh.
- `rules.py`: the one logical-axis -> mesh-axis table, params / KV specs,
  KV-head replication when `tp` exceeds the KV head count.
- `placement.py`: `Placement`, what `ModelRunner` uses to put params, the
  KV cache and its jitted steps on a mesh.
- `checkpoint.py`: orbax save / restore straight onto a mesh's shardings.
- `distributed.py`: `jax.distributed` start-up from flags or the environment.
- `attention.py`: `head_parallel`, attention kernels run per head shard.
- `hf_slices.py`: HF safetensors read per device block onto a mesh.

See docs/sharding.md.
"""

from sharding.attention import head_parallel
from sharding.mesh import AXES, ParallelConfig, make_mesh, mesh_for
from sharding.placement import Placement
from sharding.rules import LOGICAL_AXIS_RULES, PARAM_AXES, param_specs

__all__ = ["AXES", "LOGICAL_AXIS_RULES", "PARAM_AXES", "ParallelConfig", "Placement",
           "head_parallel", "make_mesh", "mesh_for", "param_specs"]
