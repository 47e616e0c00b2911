"""Multi-step decoding (`num_decode_steps`) in the scheduler and engine, on the FakeRunner.

The FakeRunner runs a multi-step row's iterations in order, writing each
input token into the row's pages and reading the whole context back before
every token, so a run planned on the wrong pages, positions or pending counts
fails with `FakeKVError`; outputs must equal the single-step engine's.
Covered: when a step is multi-step (and when not), runs cut by stop tokens
and max_tokens, prefix pages published after a run, staggered arrivals,
preemption, a failed multi-step step, and multi-step between the speculative
steps of a host proposer (ngram).
"""

from __future__ import annotations

from frontend_fake import ByteTokenizer
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.page_allocator import PageAllocator
from serving.engine.scheduler import Scheduler
from serving.spec_decode.proposers import DraftModelProposer, NgramProposer
from serving.types import SamplingParams, Sequence

PAGE = 4
K = 4


def config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=64, page_size=PAGE, num_pages=40,
              max_num_batched_tokens=16, compilation_cache=False, num_decode_steps=K,
              decode_steps_max_batch=4)
  return EngineConfig.of(**{**base, **kw})


class RecordingRunner(FakeRunner):
  """A FakeRunner that keeps each plan's decode_steps (and whether it speculated)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.decode_steps: list[int] = []
    self.speculative: list[bool] = []

  def execute(self, *, plan):
    if plan.decodes:
      self.decode_steps.append(plan.decode_steps)
      self.speculative.append(plan.speculative)
      assert all(r.num_steps == plan.decode_steps for r in plan.decodes)
    return super().execute(plan=plan)


def engine(faults: dict | None = None, **kw) -> tuple[LLMEngine, RecordingRunner]:
  cfg = config(**kw)
  inner = RecordingRunner(num_pages=cfg.cache.num_pages, page_size=PAGE,
                          max_num_seqs=cfg.scheduler.max_num_seqs, vocab_size=300)
  runner = FaultyRunner(inner, **faults) if faults is not None else inner
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=cfg), inner


def submit(eng: LLMEngine, rid: str, ids: list[int], max_tokens: int = 6, **params) -> list:
  outs: list = []
  eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True, **params), outs.append)
  return outs


def tokens_of(outs) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def echo(prompt: list[int], n: int) -> list[int]:
  """What the FakeRunner generates: prompt tokens, cycling."""
  return [prompt[i % len(prompt)] for i in range(n)]


def prompt(seed: int, n: int) -> list[int]:
  return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def assert_all_pages_free(eng: LLMEngine) -> None:
  eng.allocator.check()
  assert eng.allocator.num_free == eng.allocator.num_usable
  assert not eng.scheduler.running and not eng.scheduler.waiting


def test_one_request_runs_multi_step_and_ends_with_single_steps():
  eng, runner = engine()
  outs = submit(eng, "a", prompt(1, 7), max_tokens=23)
  eng.run_until_idle()
  assert tokens_of(outs) == echo(prompt(1, 7), 23)
  assert outs[-1].finish_reason == "length"
  # The prefill samples token 1; runs of K while K more fit, single steps for the rest.
  assert runner.decode_steps.count(K) >= 4 and set(runner.decode_steps) == {1, K}
  assert sum(runner.decode_steps) == 22
  assert_all_pages_free(eng)


def test_staggered_requests_match_the_single_step_engine():
  def run(steps: int) -> tuple[dict, list[int]]:
    eng, runner = engine(num_decode_steps=steps)
    outs = {}
    for i in range(6):  # a new request every few steps: multi-step stops while one waits
      outs[i] = submit(eng, f"r{i}", prompt(i, 3 + 2 * i), max_tokens=9 + 3 * i)
      for _ in range(3):
        eng.step()
    eng.run_until_idle()
    assert_all_pages_free(eng)
    return {i: tokens_of(o) for i, o in outs.items()}, runner.decode_steps

  single, steps1 = run(1)
  multi, steps_k = run(K)
  assert multi == single
  assert set(steps1) == {1} and K in steps_k
  assert multi == {i: echo(prompt(i, 3 + 2 * i), 9 + 3 * i) for i in range(6)}


def test_a_stop_token_inside_a_run_cuts_it():
  p = [5, 6, 7, 8, 9]
  eng, _ = engine()
  outs = submit(eng, "a", p, max_tokens=30, stop_token_ids=[8])
  eng.run_until_idle()
  # Echo: 5 6 7 8 ... stops at the first 8 (output index 3, inside the first run).
  assert tokens_of(outs) == [5, 6, 7, 8]
  assert outs[-1].finish_reason == "stop"
  assert_all_pages_free(eng)


def test_pages_written_by_a_run_are_shared_with_a_later_request():
  p = prompt(3, 6)
  eng, _ = engine()
  first = submit(eng, "first", p, max_tokens=18)
  eng.run_until_idle()
  full = p + tokens_of(first)  # 24 tokens on 6 pages; no KV for the last one yet
  pages, _ = eng.allocator.match_prefix(full)
  assert len(pages) == 5  # every page whose KV the runs wrote (the last token's is not)
  eng.allocator.release(pages)
  second = submit(eng, "second", full[:21], max_tokens=10)
  eng.run_until_idle()  # reads the shared pages back through the FakeRunner's check
  assert tokens_of(second) == echo(full[:21], 10)
  assert eng.stats().prefix_cache_hits_total > 0
  assert_all_pages_free(eng)


def test_preemption_under_multi_step_recomputes_and_matches():
  prompts = [prompt(i, 5 + i) for i in range(4)]
  eng, runner = engine(num_pages=13, max_num_batched_tokens=12)
  outs = {i: submit(eng, f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)}
  eng.run_until_idle()
  assert {i: tokens_of(o) for i, o in outs.items()} == {
      i: echo(p, 20) for i, p in enumerate(prompts)}
  assert eng.stats().num_preemptions_total > 0 and K in runner.decode_steps
  assert_all_pages_free(eng)


def test_a_failed_multi_step_step_fails_only_its_request():
  fired = []

  def once(seq) -> bool:  # the bad request's first multi-step step fails at fetch
    if seq.request_id == "bad" and seq.num_generated >= 2 and not fired:
      fired.append(seq)
      return True
    return False

  eng, runner = engine(faults=dict(fail_request=once, fail_at="fetch"))
  good = submit(eng, "good", prompt(1, 9), max_tokens=17)
  bad = submit(eng, "bad", prompt(2, 9), max_tokens=17)
  eng.run_until_idle()
  assert bad[-1].finish_reason == "error"
  assert good[-1].finish_reason == "length" and tokens_of(good) == echo(prompt(1, 9), 17)
  assert K in runner.decode_steps
  assert_all_pages_free(eng)


def scheduler(proposer=None, **kw) -> Scheduler:
  cfg = config(**kw)
  return Scheduler(cfg, PageAllocator(cfg.cache.num_pages, PAGE, cfg.cache.enable_prefix_caching),
                   proposer=proposer)


def decoding(sched: Scheduler, rid: str, max_tokens: int = 20, **params) -> Sequence:
  """A sequence admitted and past its prefill, its first token known."""
  seq = Sequence(request_id=rid, prompt_ids=prompt(len(rid), 6),
                 params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
  sched.add(seq)
  plan = sched.schedule()
  assert [c.seq for c in plan.prefills] == [seq]
  seq.pending -= 1
  seq.output_ids.append(1)
  seq.token_on_device = True
  return seq


def test_the_scheduler_plans_multi_step_only_when_nothing_else_needs_the_device():
  sched = scheduler()
  a = decoding(sched, "a")
  plan = sched.schedule()
  assert plan.decode_steps == K and plan.decodes[0].num_steps == K
  assert a.pending == K and a.num_computed == plan.decodes[0].position + K
  # Overlap: the next plan starts after the K pending tokens.
  plan2 = sched.schedule()
  assert plan2.decode_steps == K and plan2.decodes[0].position == plan.decodes[0].position + K
  # A waiting request turns it off (its prefill must not wait K steps).
  sched.add(Sequence(request_id="w", prompt_ids=prompt(9, 5), params=SamplingParams()))
  assert sched.schedule().decode_steps == 1


def test_no_multi_step_near_max_tokens_over_the_batch_cap_or_off():
  sched = scheduler()
  decoding(sched, "a", max_tokens=K)  # 1 generated: K more would pass max_tokens
  assert sched.schedule().decode_steps == 1
  sched = scheduler(decode_steps_max_batch=1)
  decoding(sched, "a")
  decoding(sched, "b")
  assert sched.schedule().decode_steps == 1
  sched = scheduler(num_decode_steps=1)
  decoding(sched, "a")
  assert sched.schedule().decode_steps == 1


def test_config_validates_the_multi_step_options():
  import pytest

  with pytest.raises(ValueError, match="num_decode_steps"):
    config(num_decode_steps=0)
  with pytest.raises(ValueError, match="decode_steps_max_batch"):
    config(decode_steps_max_batch=0)
  capped = config(decode_steps_max_batch=3, decode_buckets=(1, 2, 4)).scheduler
  assert capped.multi_step_batch_buckets == (1, 2, 4)
  assert config(num_decode_steps=1).scheduler.multi_step_batch_buckets == ()


def test_a_host_proposer_runs_multi_step_between_speculative_steps():
  """ngram drafts on the host from the tokens it has: a step that does not speculate (the
  back-off paused, or too many rows) is multi-step; a speculative one is not; one asked
  to speculate whose rows got no drafts is multi-step; a draft model (its K/V must follow
  every token) never runs multi-step."""
  sched = scheduler(NgramProposer(1, 3), speculative_method="ngram")
  decoding(sched, "a")
  assert sched.schedule(speculate=False).decode_steps == K
  sched = scheduler(NgramProposer(1, 3), speculative_method="ngram")
  seq = decoding(sched, "a")
  seq.output_ids[-1] = seq.prompt_ids[1]  # the prompt's next tokens are the drafts
  plan = sched.schedule(speculate=True)
  assert plan.speculative and plan.decode_steps == 1
  assert plan.decodes[0].drafts[:4] == seq.prompt_ids[2:]
  sched = scheduler(NgramProposer(1, 3), speculative_method="ngram")
  seq = decoding(sched, "a")  # its latest token (1) is not in the prompt: no drafts
  plan = sched.schedule(speculate=True)
  assert not plan.speculative and plan.decode_steps == K
  assert seq.pending == K and plan.decodes[0].num_drafts == 0
  sched = scheduler(DraftModelProposer(), speculative_method="draft",
                    speculative_model="unused")
  decoding(sched, "a")
  assert sched.schedule(speculate=False).decode_steps == 1


def test_ngram_and_multi_step_in_one_engine_match_the_plain_outputs():
  """Two requests over `speculative_max_batch=1` decode multi-step; once the short one has
  finished, the other speculates (the FakeRunner's echo is what ngram predicts). Outputs
  are the plain engine's."""
  eng, runner = engine(speculative_method="ngram", num_speculative_tokens=3,
                       speculative_max_batch=1, prompt_lookup_min=1)
  long = submit(eng, "long", prompt(1, 7), max_tokens=40)
  short = submit(eng, "short", prompt(2, 9), max_tokens=13)
  eng.run_until_idle()
  assert tokens_of(long) == echo(prompt(1, 7), 40)
  assert tokens_of(short) == echo(prompt(2, 9), 13)
  assert K in runner.decode_steps and any(runner.speculative)
  assert all(steps == 1 for steps, spec in zip(runner.decode_steps, runner.speculative,
                                               strict=True) if spec)
  assert_all_pages_free(eng)


def test_a_speculative_step_without_drafts_runs_multi_step():
  """One request under ngram (n-grams of 2-3): its first decode step finds no bigram of
  the prompt (the echo's first token follows the prompt's last), so the step asked to
  speculate runs K plain iterations; from then on the echo repeats the prompt and the
  steps speculate. Outputs are the plain engine's, pages all free."""
  eng, runner = engine(speculative_method="ngram", num_speculative_tokens=3,
                       prompt_lookup_min=2, prompt_lookup_max=3)
  outs = submit(eng, "a", prompt(3, 7), max_tokens=30)
  eng.run_until_idle()
  assert tokens_of(outs) == echo(prompt(3, 7), 30)
  plain = [s for s, spec in zip(runner.decode_steps, runner.speculative, strict=True)
           if not spec]
  assert plain[0] == K and any(runner.speculative)
  assert eng.spec.num_pauses == 0
  assert_all_pages_free(eng)
