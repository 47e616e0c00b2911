"""`FaultyRunner`: a Runner around another that fails or blocks chosen steps (tests only).

Faults enter through the engine's Runner interface, the way a broken device
call would, never by patching engine internals:
  * `fail_request(seq) -> bool`: a step holding such a sequence raises
    `StepError` naming those requests, from `execute` before anything is
    dispatched, or from `fetch` with `fail_at="fetch"` (when the next step is
    already in flight): a failure the runner can attribute;
  * `fail_steps`: indices (0-based, in execute order) of steps whose `fetch`
    raises a plain RuntimeError (a failure nobody can attribute);
  * `block_steps` / `block_request(seq)`: steps (by index, or holding such a
    sequence) whose `fetch` blocks until `release()` (a wedged device call);
  * `dead_from` / `dead_request(seq)`: from that step on (by index, or from
    the first step holding such a sequence), every call raises
    `RunnerDeadError` (the device state is lost);
  * `dead_export_from`: KV page exports (disaggregated serving) from that
    call on (0-based) raise `RunnerDeadError`, as do the steps after it (a
    prefill worker killed mid-transfer); `fail_imports`: those KV page
    imports raise a plain RuntimeError (a transfer that breaks).
Everything else is passed to the wrapped runner unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from serving.engine.runner_api import RunnerDeadError, StepError

Predicate = Callable[[Any], bool]


def _any(predicate: Predicate | None, plan) -> bool:
  return predicate is not None and any(predicate(s) for s in plan.sequences)


class FaultyRunner:
  """See module doc."""

  def __init__(self, runner: Any, *, fail_request: Predicate | None = None,
               fail_steps: frozenset[int] = frozenset(), block_steps: frozenset[int] = frozenset(),
               block_request: Predicate | None = None, dead_from: int | None = None,
               dead_request: Predicate | None = None, fail_at: str = "execute",
               dead_export_from: int | None = None, fail_imports: frozenset[int] = frozenset()):
    self.runner = runner
    self.num_pages, self.vocab_size = runner.num_pages, runner.vocab_size
    self.window_group = runner.window_group
    self.state_slots = runner.state_slots
    self.fail_request, self.fail_steps = fail_request, fail_steps
    self.block_steps, self.block_request = set(block_steps), block_request
    self.dead_from, self.dead_request = dead_from, dead_request
    self.fail_at = fail_at
    self.dead_export_from, self.fail_imports = dead_export_from, fail_imports
    self.num_exports = self.num_imports = 0
    self.num_executed = 0
    self.unblock = threading.Event()

  def warm_up(self) -> int:
    return self.runner.warm_up()

  def execute(self, *, plan):
    step = self.num_executed
    self.num_executed += 1
    if _any(self.dead_request, plan) and (self.dead_from is None or step < self.dead_from):
      self.dead_from = step
    if _any(self.block_request, plan):
      self.block_steps.add(step)
    self._check_dead(step)
    bad = []
    if self.fail_request is not None:
      bad = [s.request_id for s in plan.sequences if self.fail_request(s)]
    if bad and self.fail_at == "execute":
      raise StepError(f"injected fault in step {step}", bad)
    return step, bad, self.runner.execute(plan=plan)

  def sample(self, *, handle, masks):
    self.runner.sample(handle=handle[2], masks=masks)

  def fetch(self, *, handle):
    step, bad, inner = handle
    self._check_dead(step)
    if bad:
      raise StepError(f"injected fault in step {step}", bad)
    if step in self.block_steps:
      self.unblock.wait()
    if step in self.fail_steps:
      raise RuntimeError(f"injected device failure in step {step}")
    return self.runner.fetch(handle=inner)

  def export_pages(self, pages):
    call = self.num_exports
    self.num_exports += 1
    if self.dead_export_from is not None and call >= self.dead_export_from:
      self.dead_from = self.num_executed  # and every step from now on
      raise RunnerDeadError(f"injected: the device is lost (KV export {call})")
    self._check_dead(self.num_executed)
    return self.runner.export_pages(pages)

  def gather_pages(self, pages):
    """The tiered prefix cache's gather of evicted pages: an export without waiting."""
    return self.export_pages(pages)

  def kv_page_specs(self):
    return self.runner.kv_page_specs()

  def import_pages(self, pages, k, v):
    call = self.num_imports
    self.num_imports += 1
    if call in self.fail_imports:
      raise RuntimeError(f"injected KV import failure (import {call})")
    self._check_dead(self.num_executed)
    return self.runner.import_pages(pages, k, v)

  def release(self) -> None:
    """Unblocks the steps held by `block_steps`."""
    self.unblock.set()

  def close(self) -> None:
    self.unblock.set()
    self.runner.close()

  def _check_dead(self, step: int) -> None:
    if self.dead_from is not None and step >= self.dead_from:
      raise RunnerDeadError(f"injected: the device is lost (step {step})")
