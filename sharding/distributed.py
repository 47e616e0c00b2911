"""Multi-host start-up: `jax.distributed` from launcher flags or the environment.

The launcher calls `initialize_from(flags_or_config)` first thing in
`main()`, before anything touches a device. Values come from the object's
`coordinator_address`, `num_processes`, `process_id` attributes (absl
flags, an argparse namespace, a dataclass) or dict keys, and fall back to
the environment: `JAX_COORDINATOR_ADDRESS` (host:port of process 0),
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`. With one process (the default) it
does nothing; `auto=True` with nothing set lets jax detect the cluster
(TPU pod slices, SLURM, Open MPI, Kubernetes).

After start-up `jax.devices()` lists every process's devices, so
`sharding.make_mesh` builds one global mesh; see serving/runner/multihost.py for
how the processes then run the steps in lock-step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax

log = logging.getLogger(__name__)

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Where this process sits among the processes serving one model."""

  coordinator_address: str | None = None
  num_processes: int = 1
  process_id: int = 0
  initialization_timeout_s: int = 300

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes={self.num_processes} must be at least 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} must be in [0, {self.num_processes})")
    if self.num_processes > 1 and not self.coordinator_address:
      raise ValueError(f"num_processes={self.num_processes} needs a coordinator_address "
                       "(host:port of process 0; flag --coordinator_address or "
                       "$JAX_COORDINATOR_ADDRESS)")

  @property
  def is_leader(self) -> bool:
    """Process 0 runs the scheduler and the front ends."""
    return self.process_id == 0

  @classmethod
  def resolve(cls, source: Any = None, environ: Mapping[str, str] | None = None,
              **overrides) -> DistributedConfig:
    """Values from `source` (attributes or keys), else the environment, else defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, env_name in ENV.items():
      value = overrides.get(name, _get(source, name))
      if value is None and environ.get(env_name):
        value = environ[env_name]
      if value is not None:
        values[name] = value if name == "coordinator_address" else int(value)
    return cls(**values)


def initialize_from(source: Any = None, *, auto: bool = False,
                    environ: Mapping[str, str] | None = None) -> DistributedConfig:
  """Starts `jax.distributed` when more than one process is configured (see module doc).

  Idempotent; returns the resolved config (`is_leader` says whether to serve).
  """
  cfg = DistributedConfig.resolve(source, environ)
  if jax.distributed.is_initialized():
    return dataclasses.replace(cfg, num_processes=jax.process_count(),
                               process_id=jax.process_index())
  if cfg.num_processes == 1 and not auto:
    return cfg
  if cfg.num_processes == 1:  # auto: let jax detect TPU pods, SLURM, Open MPI, Kubernetes
    jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout_s)
  else:
    log.info("jax.distributed: process %d of %d, coordinator %s", cfg.process_id,
             cfg.num_processes, cfg.coordinator_address)
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id,
                               initialization_timeout=cfg.initialization_timeout_s)
  return dataclasses.replace(cfg, num_processes=jax.process_count(),
                             process_id=jax.process_index())


def _get(source: Any, name: str) -> Any:
  if source is None:
    return None
  if isinstance(source, Mapping):
    return source.get(name)
  return getattr(source, name, None)
