"""State slots (linear-attention models) through the engine on the FakeRunner.

With `state_slots=True` the FakeRunner keeps, per decode slot, the request and
the tokens folded into its state, and checks every chunk and decode token
against it (serving/engine/fake_runner.py): a slot read by another sequence, a
chunk resuming mid-sequence on a fresh slot, or a state resumed after a failed
step half-updated it raises `FakeKVError`. The workloads here — chunked prefill,
preemption, shared prefixes, multi-step decoding, failed steps — must finish
with the right tokens, and the check must fire when prefix caching is left on.
"""

from __future__ import annotations

import pytest
from frontend_fake import ByteTokenizer
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.types import SamplingParams

PAGE = 4


def config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=64, page_size=PAGE, num_pages=40,
              max_num_batched_tokens=12, compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def engine(faults: dict | None = None, runner_slots: bool = True, **kw) -> LLMEngine:
  cfg = config(**kw)
  runner = FakeRunner(num_pages=cfg.cache.num_pages, page_size=PAGE,
                      max_num_seqs=cfg.scheduler.max_num_seqs, vocab_size=300,
                      state_slots=True)
  runner = FaultyRunner(runner, **(faults or {}))
  runner.state_slots = runner_slots  # what the engine is told (the FakeRunner still checks)
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=cfg)


def prompt(seed: int, n: int) -> list[int]:
  return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def echo(p: list[int], n: int) -> list[int]:
  return [p[i % len(p)] for i in range(n)]


def submit(eng: LLMEngine, rid: str, ids: list[int], max_tokens: int = 10) -> list:
  outs: list = []
  eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True), outs.append)
  return outs


def tokens_of(outs) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def shared_prefix_prompts() -> list[list[int]]:
  system = prompt(7, 3 * PAGE)
  return [system + prompt(i, 3 + 2 * i) for i in range(6)]


@pytest.mark.parametrize("steps", [1, 4])
def test_preemption_chunks_and_shared_prefixes_keep_every_slot_its_own(steps):
  eng = engine(num_pages=14, num_decode_steps=steps)
  assert not eng.allocator.enable_prefix_caching  # turned off for state slots
  prompts = shared_prefix_prompts()
  outs = {i: submit(eng, f"r{i}", p) for i, p in enumerate(prompts)}
  eng.run_until_idle()
  assert {i: tokens_of(o) for i, o in outs.items()} == {
      i: echo(p, 10) for i, p in enumerate(prompts)}
  stats = eng.stats()
  assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total == 0


def test_the_check_catches_a_prefix_hit_that_skips_the_state():
  eng = engine(runner_slots=False)  # the engine, not told, keeps prefix caching on
  first = submit(eng, "first", shared_prefix_prompts()[0])
  eng.run_until_idle()
  assert first[-1].finish_reason == "length"
  second = submit(eng, "second", shared_prefix_prompts()[1])
  eng.run_until_idle()  # the engine fails the step the FakeRunner refused
  assert second[-1].finish_reason == "error"
  assert "state slot 0 holds 'first'" in second[-1].error


@pytest.mark.parametrize("fail_at", ["execute", "fetch"])
def test_a_failed_step_rolls_back_its_sequences_states(fail_at):
  """At "fetch" the failed step ran (its states were written) and the next step is in
  flight: the blameless sequences must restart from position 0, not resume the state."""
  fired = []

  def once(seq) -> bool:
    if seq.request_id == "bad" and seq.num_generated >= 3 and not fired:
      fired.append(seq)
      return True
    return False

  eng = engine(faults=dict(fail_request=once, fail_at=fail_at))
  good = [submit(eng, f"good{i}", prompt(i, 9 + 5 * i), max_tokens=12) for i in range(2)]
  bad = submit(eng, "bad", prompt(5, 9), max_tokens=12)
  eng.run_until_idle()
  assert fired and bad[-1].finish_reason == "error"
  for i, outs in enumerate(good):
    assert outs[-1].finish_reason == "length"
    assert tokens_of(outs) == echo(prompt(i, 9 + 5 * i), 12)
