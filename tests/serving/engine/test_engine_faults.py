"""Engine failures through the Runner seam (FakeRunner + FaultyRunner, no model).

A step that fails fails only its requests (test_scheduler.py); here the engine
itself can no longer serve: the device state is lost, the loop hits a bug, or
a device call never returns. Every request must end with an error, new ones
must be refused, and `health()` must say why (what the servers' watchdog reads).
"""

from __future__ import annotations

import threading
import time

import pytest
from frontend_fake import ByteTokenizer, fake_engine
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.llm_engine import EngineDeadError
from serving.types import SamplingParams, StepResult


def params(max_tokens: int = 200) -> SamplingParams:
  return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Outputs:
  """Collects one request's deltas; `done` is set by the last."""

  def __init__(self):
    self.deltas, self.done = [], threading.Event()

  def __call__(self, out):
    self.deltas.append(out)
    if out.finished:
      self.done.set()

  @property
  def last(self):
    return self.deltas[-1]


def started(**kw) -> LLMEngine:
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64, step_s=0.002, **kw)
  engine.start()
  return engine


def test_a_lost_device_kills_the_engine_and_every_request_hears_it():
  engine = started()
  try:
    bystander, killer = Outputs(), Outputs()
    engine.add_request("bystander", list(b"abcdef"), params(), bystander)
    assert _wait(lambda: bystander.deltas)
    engine.add_request("killer", [1, 97, 98], params(4), killer)  # \x01: the device is lost
    assert killer.done.wait(5) and bystander.done.wait(5)
    assert killer.last.finish_reason == bystander.last.finish_reason == "error"
    assert "device is lost" in bystander.last.error
    assert "device is lost" in engine.health()
    with pytest.raises(EngineDeadError, match="device is lost"):
      engine.add_request("late", list(b"xyz"), params(4), Outputs())
  finally:
    engine.shutdown()


def test_a_wedged_step_shows_in_health_after_the_timeout():
  engine = started(step_timeout_s=0.3)
  try:
    stuck = Outputs()
    engine.add_request("stuck", [2, 97], params(4), stuck)  # \x02: the fetch never returns
    assert _wait(lambda: engine.health() is not None, timeout=5)
    assert "wedged" in engine.health() and "step_timeout_s=0.3" in engine.health()
    assert not stuck.done.is_set()
  finally:
    engine.shutdown(timeout_s=1)  # releases the blocked fetch (FaultyRunner.close)


def test_healthy_while_steps_are_quick():
  engine = started(step_timeout_s=0.3)
  try:
    outs = Outputs()
    engine.add_request("ok", list(b"hello"), params(60), outs)
    assert outs.done.wait(10) and outs.last.finish_reason == "length"
    assert engine.health() is None
  finally:
    engine.shutdown()
  assert engine.health() is None  # a stopped engine is not a dead one


class _ForgetfulRunner(FakeRunner):
  """Answers the first decode step without its tokens: an engine-side bug to trip over."""

  def fetch(self, *, handle):
    result = super().fetch(handle=handle)
    return StepResult(tokens={}) if self.num_steps >= 2 else result


def test_a_bug_in_the_loop_kills_the_engine_instead_of_limping_on():
  config = EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=4, num_pages=32,
                        compilation_cache=False)
  runner = _ForgetfulRunner(num_pages=32, page_size=4, max_num_seqs=2, vocab_size=300)
  engine = LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config)
  engine.start()
  try:
    outs = Outputs()
    engine.add_request("r", list(b"abcd"), params(20), outs)
    assert outs.done.wait(5) and outs.last.finish_reason == "error"
    assert engine.health().startswith("engine failed: KeyError")
  finally:
    engine.shutdown()


def test_unattributed_step_failures_keep_the_engine_alive():
  runner = FakeRunner(num_pages=32, page_size=4, max_num_seqs=2, vocab_size=300)
  config = EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=4, num_pages=32,
                        compilation_cache=False)
  engine = LLMEngine(runner=FaultyRunner(runner, fail_steps=frozenset({0})),
                     tokenizer=ByteTokenizer(), config=config)
  first, second = Outputs(), Outputs()
  engine.add_request("first", list(b"abcd"), params(4), first)
  engine.run_until_idle()
  engine.add_request("second", list(b"abcd"), params(4), second)
  engine.run_until_idle()
  assert first.last.finish_reason == "error" and second.last.finish_reason == "length"
  assert engine.health() is None


def _wait(cond, timeout: float = 5.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if cond():
      return True
    time.sleep(0.01)
  return bool(cond())
