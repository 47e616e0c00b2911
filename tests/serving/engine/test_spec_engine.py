"""Speculative decoding in the scheduler and engine, over the FakeRunner (no model).

The FakeRunner's tokens repeat the prompt, so an n-gram or suffix proposer
predicts them once a cycle has been seen, and its "draft model" is right but
for its last draft: every path of verification (all kept, some kept, none)
runs. It writes drafts into the KV pool and reads each row's context back
before every token, so a page-accounting mistake (drafts on a page the row
does not own, a prefix hash published over rejected drafts) raises. The
outputs must be exactly those of the same engine without speculation.
"""

from __future__ import annotations

import numpy as np
import pytest
from frontend_fake import VOCAB, ByteTokenizer, fake_engine
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.spec_decode import SpecBackoff
from serving.types import SamplingParams

METHODS = [dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3),
           dict(speculative_method="suffix"),
           dict(speculative_method="draft", speculative_model="fake-draft")]


def engine(**kw):
  base = dict(max_num_seqs=4, max_model_len=128, page_size=4, num_pages=96,
              max_num_batched_tokens=32, num_speculative_tokens=4, speculative_max_batch=4)
  return fake_engine(step_s=0.0, **{**base, **kw})


def run(eng, requests):
  """requests: (id, prompt, params) -> {id: (token ids, text, finish_reason, stop_reason,
  error)}."""
  outs = {rid: [] for rid, _, _ in requests}
  for rid, prompt, params in requests:
    eng.add_request(rid, prompt, params, outs[rid].append)
  eng.run_until_idle()
  alloc = eng.allocator
  alloc.check()
  assert alloc.num_free == alloc.num_usable, "pages leaked"
  return {rid: (sum((o.token_ids for o in d), []), "".join(o.text for o in d),
                d[-1].finish_reason, d[-1].stop_reason, d[-1].error) for rid, d in outs.items()}


def greedy(max_tokens, **kw):
  return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def workload():
  rng = np.random.default_rng(0)
  reqs = []
  for i in range(4):
    prompt = [int(t) for t in rng.integers(97, 123, int(rng.integers(3, 9)))]
    reqs.append((f"r{i}", prompt, greedy(int(rng.integers(5, 40)))))
  return reqs


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["speculative_method"])
def test_outputs_equal_plain_decoding_and_drafts_are_kept(method):
  reqs = workload()
  want = run(engine(), reqs)
  eng = engine(**method)
  assert run(eng, reqs) == want
  spec = eng.stats().spec_decode
  assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
  assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1]
  if method["speculative_method"] == "draft":  # right but for the last draft
    assert spec.num_accepted_tokens < spec.num_draft_tokens


def test_max_tokens_and_context_length_cut_the_drafts():
  eng = engine(**METHODS[0])
  out = run(eng, [("a", list(b"abc"), greedy(10)),
                  ("b", list(b"xy"), greedy(None))])  # runs to max_model_len
  assert len(out["a"][0]) == 10 and out["a"][2] == "length"
  assert len(out["b"][0]) == 128 - 2 and out["b"][2] == "length"


@pytest.mark.parametrize("stop", [dict(stop=["dab"]), dict(stop_token_ids=[ord("c")]),
                                  dict(stop=["da"], include_stop_str_in_output=True)])
def test_a_stop_inside_a_kept_run_ends_the_request_there(stop):
  """The output repeats the prompt, so the first speculative step keeps a run that
  holds the stop; the request ends there, as without speculation."""
  reqs = [("a", list(b"abcdabcdabcd"), greedy(30, **stop))]
  eng = engine(**METHODS[0])
  got = run(eng, reqs)
  assert got == run(engine(), reqs)
  assert got["a"][2] == "stop" and len(got["a"][0]) < 8
  assert eng.stats().spec_decode.num_accepted_tokens > 0


def test_eos_inside_a_run_stops_and_drops_the_rest():
  eos = SamplingParams(max_tokens=30, temperature=0.0)  # EOS (id 0 in ByteTokenizer) stops
  prompt = [5, 6, 7, 5, 6, 7, 5, 6, 0, 9]  # the output reaches EOS once the cycle gets there
  want = run(engine(), [("a", prompt, eos)])
  assert run(engine(**METHODS[0]), [("a", prompt, eos)]) == want


def test_preemption_and_prefix_cache_with_speculation():
  """Pools too small for everyone, shared prefixes: preemptions, recomputes that hit the
  prefix cache (one stopping a token short of a readmitted request's context: that token
  must be prefilled, its new slot holds another request's token). 40 seeded workloads;
  outputs unchanged by speculation, no step fails."""
  preempted = hits = kept = 0
  for seed in range(40):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(97, 123, 8)]
    reqs = [(f"q{i}", shared + [int(t) for t in rng.integers(97, 123, int(rng.integers(0, 6)))],
             greedy(int(rng.integers(5, 40)))) for i in range(8)]
    kw = dict(num_pages=int(rng.integers(16, 30)), max_num_batched_tokens=16)
    want = run(engine(**kw), reqs)
    eng = engine(**kw, **METHODS[0])
    assert run(eng, reqs) == want, seed
    assert all(out[2] == "length" for out in want.values()), seed
    stats = eng.stats()
    preempted += stats.num_preemptions_total
    hits += stats.prefix_cache_hits_total
    kept += stats.spec_decode.num_accepted_tokens
  assert preempted and hits and kept


def test_no_speculation_beyond_the_batch_limit_or_with_a_constraint():
  eng = engine(speculative_max_batch=2, **METHODS[0])
  reqs = [(f"r{i}", list(b"abab"), greedy(12)) for i in range(3)]
  run(eng, reqs)
  assert eng.stats().spec_decode.num_drafts == 0  # three decode together: over the limit


@pytest.mark.parametrize("method", [METHODS[0], METHODS[2]], ids=["ngram", "draft"])
def test_constrained_requests_speculate_within_their_grammar(default_tokenizer, method):
  """Host drafts are cut to what the grammar allows and verified with a mask per
  position; a draft model's drafts (unseen by the host) are not used for a constrained
  row, which still runs in the speculative step. Outputs equal plain decoding."""
  ids = default_tokenizer.encode("yes no yes no maybe yes no", add_special_tokens=False)
  reqs = [("c", ids, SamplingParams(max_tokens=14, temperature=0.0,
                                    structured_outputs={"regex": "( ?(yes|no)){3,12}"})),
          ("free", ids, greedy(14))]
  plans = []
  spec = run(engine_over(default_tokenizer, plans, **method), reqs)
  assert spec == run(engine_over(default_tokenizer, []), reqs)
  assert spec["c"][2] in ("stop", "length")
  with_grammar = [(speculative, drafts) for speculative, has_grammar, drafts in plans
                  if has_grammar]
  assert any(speculative for speculative, _ in with_grammar)
  if method is METHODS[0]:
    assert any(drafts for _, drafts in with_grammar)  # the constrained row's own drafts
  else:
    assert not any(drafts for _, drafts in with_grammar)


@pytest.mark.parametrize("stop", [{}, dict(stop_token_ids=[2])], ids=["eos", "stop_id"])
def test_a_grammar_completed_inside_a_run_ends_the_request_there(default_tokenizer, stop):
  """The prompt is the whole output, then EOS (2): the first speculative step keeps drafts
  that complete the grammar and then the EOS it allows. The request ends where the grammar
  completed, without the EOS (or a stop reason from it), as without speculation."""
  ids = default_tokenizer.encode("yes no yes", add_special_tokens=False) + [2]
  reqs = [("c", ids, SamplingParams(max_tokens=14, temperature=0.0,
                                    structured_outputs={"regex": "yes no yes"}, **stop))]
  plans = []
  got = run(engine_over(default_tokenizer, plans, **METHODS[0]), reqs)
  assert got == run(engine_over(default_tokenizer, []), reqs)
  assert got["c"][:4] == (ids[:-1], "yes no yes", "stop", None)
  assert any(speculative and drafts for speculative, _, drafts in plans)


class _Recording:
  """A Runner that notes (speculative?, request ids) of every plan it passes on."""

  def __init__(self, runner, plans):
    self.runner, self.plans = runner, plans
    self.num_pages, self.vocab_size = runner.num_pages, runner.vocab_size
    self.window_group = runner.window_group
    self.state_slots = runner.state_slots

  def __getattr__(self, name):
    return getattr(self.runner, name)

  def execute(self, *, plan):
    self.plans.append((plan.speculative, [s.request_id for s in plan.sequences]))
    return self.runner.execute(plan=plan)


class _PlanRecorder(FakeRunner):
  """Notes (speculative?, holds a constrained row?, the constrained rows' drafts)."""

  def __init__(self, plans, **kw):
    super().__init__(**kw)
    self.plans = plans

  def execute(self, *, plan):
    drafts = [r.num_drafts for r in plan.decodes if r.seq.grammar is not None]
    self.plans.append((plan.speculative, bool(plan.constrained), sum(drafts)))
    return super().execute(plan=plan)


def engine_over(tokenizer, plans, **kw):
  config = EngineConfig.of(max_num_seqs=4, max_model_len=128, page_size=4, num_pages=96, **kw)
  runner = _PlanRecorder(plans, num_pages=96, page_size=4, max_num_seqs=4,
                         vocab_size=tokenizer.vocab_size)
  return LLMEngine(runner=runner, tokenizer=tokenizer, config=config)


@pytest.mark.parametrize("fail_at", ["execute", "fetch"])
def test_a_failed_speculative_step_fails_only_its_request(fail_at):
  """"bad" fails in a speculative step (named by the runner): it alone ends with an error;
  "ok", in the same step, is rolled back, recomputed and ends as without speculation."""
  config = EngineConfig.of(max_num_seqs=4, max_model_len=128, page_size=4, num_pages=96,
                        num_speculative_tokens=4, **METHODS[0])
  fake = FakeRunner(num_pages=96, page_size=4, max_num_seqs=4, vocab_size=VOCAB)
  plans = []

  def bad_in_a_speculative_step(seq):
    return seq.request_id == "bad" and len(seq.output_ids) >= 6

  runner = FaultyRunner(fake, fail_request=bad_in_a_speculative_step, fail_at=fail_at)
  eng = LLMEngine(runner=_Recording(runner, plans), tokenizer=ByteTokenizer(), config=config)
  reqs = [("ok", list(b"abcabc"), greedy(20)), ("bad", list(b"xyzxyz"), greedy(20))]
  out = run(eng, reqs)
  assert out["bad"][2] == "error" and "step failed" in out["bad"][4]
  assert out["ok"] == run(engine(), [reqs[0]])["ok"]
  assert any(speculative and "bad" in ids for speculative, ids in plans)


def test_backoff_pauses_on_low_acceptance_and_tries_again():
  b = SpecBackoff(enabled=True, max_batch=4, window=4, min_accepted=0.5, pause_steps=3)
  assert not b.wants_step(0) and not b.wants_step(5)
  for _ in range(4):
    assert b.wants_step(2)
    b.record(rows=2, kept=0)
  assert [b.wants_step(2) for _ in range(4)] == [False, False, False, True]
  assert b.num_pauses == 1
  for _ in range(8):
    b.record(rows=2, kept=2)
  assert b.wants_step(2) and b.num_pauses == 1
  assert not SpecBackoff(enabled=False, max_batch=4).wants_step(1)
