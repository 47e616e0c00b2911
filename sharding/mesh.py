"""The device mesh: four named axes built from a parallelism config.

Axes, outermost first: `dp` (replicas inside one slice), `pp` (pipeline
stages: consecutive layers and their KV pages, sharding/pipeline.py), `ep`
(MoE experts), `tp` (tensor parallel: attention heads, MLP columns, vocab).
`tp` is the innermost axis so its collectives, issued every layer, run
between neighbouring devices; `pp` sits outside it because a stage passes
only one activation per microbatch to the next (the axis for slow links:
across hosts). Axis types are `Auto` (GSPMD propagation from the
placed params and KV cache), not jax's newer `Explicit` default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax

AXES = ("dp", "pp", "ep", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """Sizes of the mesh axes; their product is the number of devices used."""

  tp: int = 1
  ep: int = 1
  dp: int = 1
  pp: int = 1

  def __post_init__(self):
    for name in AXES:
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

  @property
  def num_devices(self) -> int:
    return self.tp * self.ep * self.dp * self.pp

  @classmethod
  def of(cls, layout) -> ParallelConfig:
    """From anything with `tp`, `ep`, `dp` and `pp` attributes (an engine config's
    `parallel` group, a namespace)."""
    return cls(tp=int(layout.tp or 1), ep=int(layout.ep or 1), dp=int(layout.dp or 1),
               pp=int(layout.pp or 1))


def make_mesh(parallel: ParallelConfig,
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A `(dp, pp, ep, tp)` mesh over `devices` (default: all global devices).

  One process may use a prefix of its devices; with several processes the
  mesh must span every device, so all of them run the steps in lock-step.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = parallel.num_devices
  if n > len(devices):
    raise ValueError(f"tp*ep*dp*pp = {parallel.tp}*{parallel.ep}*{parallel.dp}*{parallel.pp} = "
                     f"{n} needs {n} "
                     f"devices but only {len(devices)} are visible "
                     f"({devices[0].platform}; on CPU set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={n} or jax_num_cpu_devices)")
  if n < len(devices) and jax.process_count() > 1:
    raise ValueError(f"tp*ep*dp*pp = {n} must equal the {len(devices)} devices of all "
                     f"{jax.process_count()} processes: every process runs the same steps")
  shape = (parallel.dp, parallel.pp, parallel.ep, parallel.tp)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices[:n])


def mesh_for(layout, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh | None:
  """The mesh for a parallel layout (`tp`, `ep`, `dp`, `pp`), or None when it is one device."""
  parallel = ParallelConfig.of(layout)
  return make_mesh(parallel, devices) if parallel.num_devices > 1 else None


def axis_size(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
              axes: str | tuple[str, ...] | None) -> int:
  """Number of shards along one mesh axis, a tuple of axes, or None (1)."""
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else axes
  shape = dict(mesh.shape)
  return math.prod(shape.get(a, 1) for a in names)

