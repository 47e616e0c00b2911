"""Multi-host serving: process 0 schedules and serves, every process runs the steps.

With several processes (`sharding.distributed.initialize_from`) the mesh
spans all their devices, and every jitted step must be launched by every
process with the same inputs. Lifecycle:
  1. All processes load the model and agree on `num_pages`
     (`agree_config`: the smallest capacity any process computed).
  2. Process 0 builds the `LLMEngine` (its runner places params and warms
     up); the others build a `ModelRunner` with the same config and warm up
     too: the same programs in the same order, so in lock-step
     (`start`).
  3. Process 0 then drives its runner through `LeaderRunner`: before each
     `prefill` / `decode` it broadcasts a header (op, bucket size, sample?)
     and then the step's inputs (`broadcast_one_to_all`); `follower_loop`
     on the other processes receives both and calls the same runner method.
  4. `LeaderRunner.stop()` broadcasts STOP; followers return.
Only process 0 fetches results (`jax.device_get` of replicated outputs
reads the local copy) and runs front ends.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

import sharding
from serving.config import EngineConfig
from serving.runner import ModelRunner

log = logging.getLogger(__name__)

STOP, PREFILL, DECODE = 0, 1, 2


def agree_config(model_cfg, config: EngineConfig) -> EngineConfig:
  """`config` with `num_pages` set to the smallest capacity any process can hold."""
  if config.num_pages is not None:
    return config
  from serving.engine_io import capacity_pages

  pages = multihost_utils.process_allgather(np.int64(capacity_pages(model_cfg, config)))
  return dataclasses.replace(config, num_pages=int(np.min(pages)))


def _broadcast_header(op: int = STOP, size: int = 0, sample: bool = False) -> tuple[int, int, bool]:
  header = multihost_utils.broadcast_one_to_all(np.array([op, size, int(sample)], np.int32))
  return int(header[0]), int(header[1]), bool(header[2])


class LeaderRunner:
  """Process 0's runner: announces every step to the followers, then runs it."""

  def __init__(self, runner: ModelRunner):
    self.runner = runner

  def __getattr__(self, name):  # engine_cfg, dummy_slot, kv_dtype_name, ...
    return getattr(self.runner, name)

  def prefill(self, inp, sample: bool = True):
    _broadcast_header(PREFILL, inp.tokens.shape[0], sample)
    return self.runner.prefill(multihost_utils.broadcast_one_to_all(inp), sample)

  def decode(self, inp):
    _broadcast_header(DECODE, inp.slots.shape[0])
    return self.runner.decode(multihost_utils.broadcast_one_to_all(inp))

  def stop(self) -> None:
    """Releases the followers (their `follower_loop` returns)."""
    _broadcast_header(STOP)


def follower_loop(runner: ModelRunner) -> int:
  """Runs the leader's steps until it stops; returns the number of steps."""
  steps = 0
  while True:
    op, size, sample = _broadcast_header()
    if op == STOP:
      return steps
    if op == PREFILL:
      runner.prefill(multihost_utils.broadcast_one_to_all(runner.dummy_prefill(size)), sample)
    elif op == DECODE:
      runner.decode(multihost_utils.broadcast_one_to_all(runner.dummy_decode(size)))
    else:
      raise RuntimeError(f"unknown step op {op} from the leader")
    steps += 1


def start(model, config: EngineConfig):
  """Every process calls this after `initialize_from`: process 0 gets the engine
  (`lead`), the others follow until it stops (`follow`) and get None."""
  if jax.process_index() == 0:
    return lead(model, config)
  follow(model, config)
  return None


def lead(model, config: EngineConfig):
  """Process 0: an `LLMEngine` whose runner is a `LeaderRunner`.

  Call `engine.runner.stop()` when done to release the followers.
  """
  from serving.engine import LLMEngine

  loaded = _load(model, config)
  engine = LLMEngine(loaded, agree_config(loaded.config, config))
  engine.runner = LeaderRunner(engine.runner)
  return engine


def follow(model, config: EngineConfig) -> int:
  """Processes 1..n-1: the same runner, warmed up, then `follower_loop`; returns its steps."""
  loaded = _load(model, config)
  config = agree_config(loaded.config, config)
  runner = ModelRunner(loaded.params, loaded.config, config, num_pages=config.num_pages)
  del loaded
  runner.warm_up()
  steps = follower_loop(runner)
  log.info("follower %d: leader stopped after %d steps", jax.process_index(), steps)
  return steps


def _load(model, config: EngineConfig):
  """Checks that the mesh spans every process's devices, then loads the model (host)."""
  import checkpoints

  devices = sharding.ParallelConfig.of(config).num_devices
  if devices != len(jax.devices()):
    raise ValueError(f"tp*ep*dp = {devices} must equal the {len(jax.devices())} devices of all "
                     f"{jax.process_count()} processes (one global mesh runs every step)")
  return model if hasattr(model, "params") else checkpoints.load_checkpoint(model)
