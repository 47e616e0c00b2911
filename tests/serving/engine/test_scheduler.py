"""The scheduler and engine on the FakeRunner: no jax, no model, milliseconds a test.

The FakeRunner keeps a host-side KV pool and checks that every context it
reads back through a sequence's pages is that sequence's own tokens, so a
page-accounting bug fails these tests with `FakeKVError` rather than passing
quietly. Covered: admission order and slots, chunked prefill within the token
budget, prefix sharing (published only after the writing step), preemption
order and recomputation, aborts, page accounting, and failed steps.
"""

from __future__ import annotations

import pytest
from frontend_fake import ByteTokenizer
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeKVError, FakeRunner
from serving.engine.page_allocator import PageAllocator
from serving.engine.scheduler import Scheduler
from serving.types import SamplingParams, Sequence, SequenceStatus

PAGE = 4


def config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=64, page_size=PAGE, num_pages=40,
              max_num_batched_tokens=16, compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


class Harness:
  """Scheduler + FakeRunner stepped like the engine: step N is postprocessed after step
  N+1 has been scheduled and dispatched (so decodes read a token still in flight)."""

  def __init__(self, **kw):
    self.config = config(**kw)
    self.allocator = PageAllocator(self.config.cache.num_pages, PAGE,
                                   self.config.cache.enable_prefix_caching)
    self.scheduler = Scheduler(self.config, self.allocator)
    self.runner = FakeRunner(num_pages=self.config.cache.num_pages, page_size=PAGE,
                             max_num_seqs=self.config.scheduler.max_num_seqs, vocab_size=300)
    self.inflight = None

  def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    seq = Sequence(request_id=rid, prompt_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    self.scheduler.add(seq)
    return seq

  def step(self):
    plan = self.scheduler.schedule()
    inflight = (plan, self.runner.execute(plan=plan)) if not plan.empty else None
    if self.inflight is not None:
      done, handle = self.inflight
      self.scheduler.postprocess(done, self.runner.fetch(handle=handle))
    self.inflight = inflight
    self.allocator.check()
    return plan

  def run(self, limit: int = 200) -> None:
    for _ in range(limit):
      if not (self.scheduler.running or self.scheduler.waiting or self.inflight):
        return
      self.step()
    raise AssertionError("did not finish")


def echo(prompt: list[int], n: int) -> list[int]:
  """What the FakeRunner generates: prompt tokens, cycling."""
  return [prompt[i % len(prompt)] for i in range(n)]


def prompt(seed: int, n: int) -> list[int]:
  return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


# ---- scheduler ----


def test_admission_is_fcfs_within_the_decode_slots():
  h = Harness(max_num_seqs=2)
  seqs = [h.add(f"r{i}", prompt(i, 5)) for i in range(4)]
  h.step()
  assert h.scheduler.running == seqs[:2]
  assert list(h.scheduler.waiting) == seqs[2:]
  assert sorted(s.decode_slot for s in seqs[:2]) == [0, 1]
  h.run()
  assert [s.output_ids for s in seqs] == [echo(s.prompt_ids, 4) for s in seqs]
  assert [s.finish_reason for s in seqs] == ["length"] * 4


def test_a_sequence_runs_to_max_model_len_with_a_step_in_flight():
  """The token that reaches max_model_len - 1 arrives while the next step, planned from it,
  is in flight: the sequence is not at the limit yet and takes that step's token too
  (counting the pending token finished it one short)."""
  h = Harness(max_model_len=16)
  seq = h.add("r", prompt(0, 3), max_tokens=None)
  h.run()
  assert (len(seq.output_ids), seq.finish_reason) == (16 - 3, "length")
  assert seq.output_ids == echo(seq.prompt_ids, 16 - 3)


def test_long_prompt_is_chunked_within_the_token_budget():
  h = Harness(max_num_batched_tokens=16)
  long = h.add("long", prompt(1, 40))
  plans = [h.step() for _ in range(3)]
  chunks = [(c.start, c.end, c.sample) for p in plans for c in p.prefills]
  assert chunks == [(0, 16, False), (16, 32, False), (32, 40, True)]
  # A decoding sequence takes one token of the budget from the next prefill.
  other = h.add("other", prompt(2, 30))
  plan = h.step()
  assert [r.seq for r in plan.decodes] == [long]
  assert [(c.start, c.end) for c in plan.prefills] == [(0, 15)]
  h.run()
  assert long.output_ids == echo(long.prompt_ids, 4)
  assert other.output_ids == echo(other.prompt_ids, 4)


def test_prefix_pages_are_shared_only_after_the_step_that_writes_them():
  h = Harness()
  system = prompt(3, 3 * PAGE)
  a = h.add("a", system + [9, 9])
  h.step()  # a's prefill is in flight, not yet completed
  b = h.add("b", system + [8])
  h.step()  # b is planned before a's step completes, then a's step is postprocessed
  assert not set(a.pages) & set(b.pages)  # nothing was published yet: b computes its own
  c = h.add("c", system + [7, 7, 7])
  h.step()
  assert c.pages[:3] == a.pages[:3]  # published now: c shares a's three full pages
  assert all(h.allocator.refcount(p) >= 2 for p in a.pages[:3])
  h.run()
  assert c.output_ids == echo(c.prompt_ids, 4)
  assert h.allocator.stats.hits >= 3 * PAGE


def test_preemption_takes_the_newest_and_recomputes_it():
  # 12 usable pages: three 16-token prompts fill them; the first decode needs a 5th page.
  h = Harness(num_pages=13, max_num_batched_tokens=64)
  seqs = [h.add(f"r{i}", prompt(i, 16), max_tokens=8) for i in range(3)]
  h.step()
  assert h.scheduler.running == seqs
  while h.scheduler.num_preemptions == 0:
    h.step()
  assert seqs[2].status is SequenceStatus.WAITING and h.scheduler.waiting[0] is seqs[2]
  assert seqs[2].pages == [] and seqs[2].decode_slot is None
  h.run()
  assert [s.output_ids for s in seqs] == [echo(s.prompt_ids, 8) for s in seqs]
  assert h.allocator.num_free == h.allocator.num_usable


def test_the_kv_check_catches_a_page_bug():
  """The oracle itself: a page overwritten under a running sequence is noticed."""
  h = Harness()
  seq = h.add("victim", prompt(5, 10), max_tokens=8)
  h.step()
  h.runner.kv[seq.pages[0]][1] = (0, 299) # what a page handed to two owners would do
  with pytest.raises(FakeKVError, match="victim"):
    h.step()


# ---- engine ----


def engine(faults: dict | None = None, **kw) -> LLMEngine:
  cfg = config(**kw)
  runner = FakeRunner(num_pages=cfg.cache.num_pages, page_size=PAGE,
                      max_num_seqs=cfg.scheduler.max_num_seqs, vocab_size=300)
  if faults is not None:
    runner = FaultyRunner(runner, **faults)
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=cfg)


def submit(eng: LLMEngine, rid: str, ids: list[int], max_tokens: int = 6) -> list:
  outs: list = []
  eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True), outs.append)
  return outs


def tokens_of(outs) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def assert_all_pages_free(eng: LLMEngine) -> None:
  eng.allocator.check()
  assert eng.allocator.num_free == eng.allocator.num_usable
  assert not eng.scheduler.running and not eng.scheduler.waiting


def test_engine_aborts_waiting_and_running_requests():
  eng = engine(max_num_seqs=1)
  running = submit(eng, "running", prompt(1, 8), max_tokens=30)
  waiting = submit(eng, "waiting", prompt(2, 8))
  eng.step()
  eng.step()
  eng.abort("running")
  eng.abort("waiting")
  eng.run_until_idle()
  assert running[-1].finish_reason == waiting[-1].finish_reason == "abort"
  assert tokens_of(running) == echo(prompt(1, 8), len(tokens_of(running)))
  assert tokens_of(waiting) == []
  assert_all_pages_free(eng)


def test_engine_fails_only_the_requests_a_step_names():
  bad_prompt = [0] + prompt(4, 3 * PAGE)
  eng = engine(faults=dict(fail_request=lambda s: s.prompt_ids[0] == 0))
  good = [submit(eng, f"good{i}", prompt(i, 9)) for i in range(2)]
  bad = submit(eng, "bad", bad_prompt)
  eng.run_until_idle()
  assert bad[-1].finish_reason == "error" and "injected fault" in bad[-1].error
  for i, outs in enumerate(good):  # rolled back with the failed step, then recomputed
    assert outs[-1].finish_reason == "length" and tokens_of(outs) == echo(prompt(i, 9), 6)
  pages, _ = eng.allocator.match_prefix(bad_prompt)  # no hash of the failed step survives
  assert pages == []
  assert_all_pages_free(eng)


def test_engine_fails_a_whole_step_it_cannot_attribute_and_nothing_else():
  eng = engine(faults=dict(fail_steps=frozenset({1})), max_num_seqs=2)
  first = [submit(eng, f"a{i}", prompt(i, 6)) for i in range(2)]
  later = submit(eng, "later", prompt(9, 6))  # waits for a slot: not in the failing step
  eng.run_until_idle()
  assert [o[-1].finish_reason for o in first] == ["error", "error"]
  assert later[-1].finish_reason == "length" and tokens_of(later) == echo(prompt(9, 6), 6)
  assert_all_pages_free(eng)


def test_engine_matches_alone_under_preemption_and_prefix_sharing():
  system = prompt(7, 2 * PAGE)
  prompts = [system + prompt(i, 3 + i) for i in range(6)]
  alone = {}
  for i, p in enumerate(prompts):
    eng = engine()
    outs = submit(eng, "x", p, max_tokens=10)
    eng.run_until_idle()
    alone[i] = tokens_of(outs)
  eng = engine(num_pages=12, max_num_batched_tokens=12)
  outs = {i: submit(eng, f"r{i}", p, max_tokens=10) for i, p in enumerate(prompts)}
  eng.run_until_idle()
  assert {i: tokens_of(o) for i, o in outs.items()} == alone
  stats = eng.stats()
  assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
  assert_all_pages_free(eng)


def test_a_failure_seen_at_fetch_drops_the_next_steps_tokens_of_its_sequences():
  """Step N fails when it is fetched, after step N+1 (which decodes from N's tokens) was
  dispatched. The blameless sequences are rolled back; N+1's tokens for them were
  sampled after a token that was never kept and must be dropped, not appended."""
  fired = []

  def once(seq) -> bool:  # fails one step only: the next one, in flight, must not fail
    if seq.request_id == "bad" and seq.num_generated >= 3 and not fired:
      fired.append(seq)
      return True
    return False

  eng = engine(faults=dict(fail_request=once, fail_at="fetch"))
  good = submit(eng, "good", prompt(1, 9), max_tokens=12)
  bad = submit(eng, "bad", prompt(2, 9), max_tokens=12)
  eng.run_until_idle()
  assert bad[-1].finish_reason == "error"
  assert good[-1].finish_reason == "length"
  assert tokens_of(good) == echo(prompt(1, 9), 12)
  assert_all_pages_free(eng)
