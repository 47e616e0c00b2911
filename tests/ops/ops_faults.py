"""The real engine with one injected fault, for the fault-isolation tests.

`faulty_engine` is the default model's engine built as `xlaserve serve` builds
it, with its `ModelRunner` inside a `FaultyRunner` (tests/runner_faults.py):
a step holding a request whose prompt token ids start with `POISON_PREFIX`, or
whose seed is `POISON_SEED`, fails with a `StepError` naming that request, the
way a device call that one request breaks would (the seed lets a failing
request share its prompt, and so its prefix pages, with healthy ones).
Started with `launch_with.py ops_faults:faulty_engine`.
"""

from __future__ import annotations

import functools

from runner_faults import FaultyRunner

from serving.entrypoints.engine_builder import build_engine

POISON_PREFIX = [13, 13, 13, 13, 13, 13, 13]
POISON_SEED = 13013


def _poisoned(seq) -> bool:
  return seq.prompt_ids[:len(POISON_PREFIX)] == POISON_PREFIX or seq.params.seed == POISON_SEED


def faulty_engine(model, config):
  """`build_engine(model, config)` with poisoned requests failing their steps."""
  return build_engine(model, config,
                      wrap_runner=functools.partial(FaultyRunner, fail_request=_poisoned))
