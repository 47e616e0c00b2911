"""Multi-host lock-step: process 0 schedules and serves, every process runs the steps.

With several processes (`sharding.distributed.initialize_from`) the mesh
spans all their devices, and every jitted step must be launched by every
process with the same inputs. Lifecycle:
  1. All processes load the model and agree on `num_pages`
     (`agree_config`: the smallest capacity any process computed).
  2. Process 0 builds the `LLMEngine` over a `LeaderRunner` (a `ModelRunner`
     behind the engine's Runner interface); the others build a `ModelRunner`
     with the same config. All warm up the same programs in the same order.
  3. For every device call of a step, the leader broadcasts a header (op,
     bucket size, sample?, sampling deferred?) and then the call's inputs
     (`broadcast_one_to_all`); `follower_loop` on the other processes
     receives both and makes the same call. A step with constrained requests
     (structured output) samples later: for each waiting sampler call the
     leader broadcasts a SAMPLE header and the call's token masks, and every
     process runs that sampler call (the oldest waiting one) with them.
     A speculative step's verify call (n-gram / suffix drafts, host-proposed)
     goes out as a VERIFY header, its input and its drafts.
  4. `LeaderRunner.close()` broadcasts STOP; followers return.
Only process 0 fetches results (`jax.device_get` of replicated outputs
reads the local copy) and runs front ends. Starting the processes is the
entry points' job (serving/entrypoints/engine_builder.py).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from jax.experimental import multihost_utils

from serving.config import EngineConfig
from serving.runner.inputs import StepInputs, build_step_inputs
from serving.runner.model_runner import ModelRunner, SamplerCall, StepHandle, capacity_pages
from serving.types import StepPlan, StepResult

STOP, PREFILL, DECODE, SAMPLE, VERIFY = 0, 1, 2, 3, 4


def agree_config(model_cfg, config: EngineConfig) -> EngineConfig:
  """`config` with `num_pages` set to the smallest capacity any process can hold."""
  if config.cache.num_pages is not None:
    return config
  pages = multihost_utils.process_allgather(np.int64(capacity_pages(model_cfg, config)))
  return config.replace(num_pages=int(np.min(pages)))


def _broadcast_header(op: int = STOP, size: int = 0, sample: bool = False,
                      defer: bool = False) -> tuple[int, int, bool, bool]:
  header = multihost_utils.broadcast_one_to_all(
      np.array([op, size, int(sample), int(defer)], np.int32))
  return int(header[0]), int(header[1]), bool(header[2]), bool(header[3])


class LeaderRunner:
  """Process 0's runner: announces every device call to the followers, then makes it."""

  def __init__(self, runner: ModelRunner):
    self.runner = runner
    self.num_pages, self.vocab_size = runner.num_pages, runner.vocab_size
    self.window_group = runner.window_group
    self.state_slots = runner.state_slots

  def warm_up(self) -> int:
    return self.runner.warm_up()

  def execute(self, *, plan: StepPlan) -> StepHandle:
    inputs = build_step_inputs(plan, self.runner.engine_cfg,
                               window=self.runner.window_group is not None)
    defer = bool(inputs.constrained)
    prefills = []
    for inp, ids in zip(inputs.prefills, inputs.prefill_ids, strict=True):
      _broadcast_header(PREFILL, inp.tokens.shape[0], bool(ids), defer)
      prefills.append(multihost_utils.broadcast_one_to_all(inp))
    decode = None
    if inputs.decode is not None:
      _broadcast_header(DECODE, inputs.decode.decode_slots.shape[0], defer=defer)
      decode = multihost_utils.broadcast_one_to_all(inputs.decode)
    verify, drafts = inputs.verify, inputs.drafts
    if verify is not None:
      _broadcast_header(VERIFY, verify.decode_slots.shape[0], defer=defer)
      verify, drafts = multihost_utils.broadcast_one_to_all((verify, drafts))
    return self.runner.run(dataclasses.replace(inputs, prefills=prefills, decode=decode,
                                               verify=verify, drafts=drafts))

  def sample(self, *, handle: StepHandle, masks) -> None:
    """Each waiting sampler call: its masks to every process, then the call everywhere."""
    for call in handle.calls:
      if call.out is None:
        allowed = self.runner.mask_rows(call, masks)
        _broadcast_header(SAMPLE, allowed.shape[0])
        self.runner.sample_call(call, multihost_utils.broadcast_one_to_all(allowed))

  def fetch(self, *, handle: StepHandle) -> StepResult:
    return self.runner.fetch(handle=handle)

  def close(self) -> None:
    """Releases the followers (their `follower_loop` returns)."""
    _broadcast_header(STOP)


def follower_loop(runner: ModelRunner) -> int:
  """Makes the leader's device calls until it stops; returns the number of calls."""
  calls = 0
  waiting: collections.deque[SamplerCall] = collections.deque()  # deferred sampler calls
  while True:
    op, size, sample, defer = _broadcast_header()
    constrained = [""] if defer else []
    if op == STOP:
      return calls
    if op == PREFILL:
      inp = multihost_utils.broadcast_one_to_all(runner.dummy_prefill(size))
      handle = runner.run(StepInputs(prefills=[inp], prefill_ids=[[""] if sample else []],
                                     decode=None, decode_ids=[], constrained=constrained))
      waiting.extend(c for c in handle.calls if c.out is None)
    elif op == DECODE:
      inp = multihost_utils.broadcast_one_to_all(runner.dummy_decode(size))
      handle = runner.run(StepInputs(prefills=[], prefill_ids=[], decode=inp,
                                     decode_ids=[""] * size, constrained=constrained))
      waiting.extend(c for c in handle.calls if c.out is None)
    elif op == VERIFY:
      inp = runner.dummy_verify(size)
      drafts = np.zeros((size, runner.engine_cfg.speculative.num_speculative_tokens), np.int32)
      inp, drafts = multihost_utils.broadcast_one_to_all((inp, drafts))
      handle = runner.run(StepInputs(prefills=[], prefill_ids=[], decode=None,
                                     decode_ids=[""] * size, constrained=constrained,
                                     verify=inp, drafts=drafts))
      waiting.extend(c for c in handle.calls if c.out is None)
    elif op == SAMPLE:
      call = waiting.popleft()
      allowed = np.zeros((*call.mask_shape, runner.mask_width), np.int32)
      runner.sample_call(call, multihost_utils.broadcast_one_to_all(allowed))
    else:
      raise RuntimeError(f"unknown step op {op} from the leader")
    calls += 1
