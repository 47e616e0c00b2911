"""Structured output through the engine loop (FakeRunner, the default model's tokenizer).

The FakeRunner samples a constrained request only when the engine hands it the
token masks, and then only allowed tokens (fake_runner.py), so these tests
check the engine's half: grammars advance exactly with the tokens kept, masks
come for the right requests at the right time (the step after the previous
one's tokens), complete grammars stop the request, and failures stay with
their request.
"""

import json
import re

import jsonschema
import pytest
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.types import SamplingParams

V = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(default_tokenizer):
  return default_tokenizer


def make_engine(tok, runner=None, **kw):
  base = dict(max_num_seqs=4, max_model_len=256, page_size=4, num_pages=128,
              max_num_batched_tokens=16, compilation_cache=False)
  config = EngineConfig.of(**{**base, **kw})
  runner = runner or FakeRunner(num_pages=config.cache.num_pages, page_size=config.cache.page_size,
                                max_num_seqs=config.scheduler.max_num_seqs, vocab_size=V)
  return LLMEngine(runner=runner, tokenizer=tok, config=config)


def run(engine, requests):
  """requests: {id: (prompt text, SamplingParams)} -> {id: (text, finish_reason, error)}."""
  outs = {rid: [] for rid in requests}
  for rid, (prompt, params) in requests.items():
    engine.add_request(rid, prompt, params, outs[rid].append)
  engine.run_until_idle()
  return {rid: ("".join(o.text for o in v), v[-1].finish_reason, v[-1].error)
          for rid, v in outs.items()}


PROMPTS = ["Tell me about Bob, who likes xylophones.", "7 out of 10 dentists", "yes or no?",
           "Write: name=Al, tags x y, n=42", "Some unconstrained request here"]


def constrained(i, max_tokens=60):
  specs = [dict(json=SCHEMA), dict(regex=r"(yes|no)( [a-z]{1,6}){0,3}\."),
           dict(choice=["alpha", "beta", "gamma"]), dict(json_object=True),
           dict(grammar='start: "n=" /[0-9]{1,4}/ ";"')]
  return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        structured_outputs=specs[i % len(specs)])


def check_output(params, text, reason):
  spec = params.structured_outputs
  if reason == "length":
    return  # a prefix; the grammar was cut by max_tokens
  assert reason == "stop", (text, reason)
  if spec.kind == "json":
    jsonschema.validate(json.loads(text), SCHEMA)
  elif spec.kind == "json_object":
    assert isinstance(json.loads(text), dict)
  elif spec.kind == "regex":
    assert re.fullmatch(spec.regex, text), text
  elif spec.kind == "choice":
    assert text in spec.choice
  else:
    assert re.fullmatch(r"n=[0-9]{1,4};", text), text


def test_every_kind_of_constraint_holds(tok):
  engine = make_engine(tok)
  reqs = {f"r{i}": (PROMPTS[i % len(PROMPTS)], constrained(i, max_tokens=200))
          for i in range(10)}
  results = run(engine, reqs)
  for rid, (text, reason, error) in results.items():
    assert error is None
    check_output(reqs[rid][1], text, reason)
  assert sum(r == "stop" for _, r, _ in results.values()) >= 8


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(tok):
  plain = {f"p{i}": (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
           for i, p in enumerate(PROMPTS)}
  alone = run(make_engine(tok), plain)
  mixed = {**plain, **{f"c{i}": (PROMPTS[i], constrained(i)) for i in range(5)}}
  together = run(make_engine(tok), mixed)
  assert {k: together[k] for k in plain} == alone


def test_max_tokens_cuts_a_grammar_that_cannot_finish(tok):
  params = SamplingParams(max_tokens=5, temperature=0.0,
                          structured_outputs={"regex": "a[a-z]{100,}b"})
  (text, reason, error), = run(make_engine(tok), {"r": ("aaaa", params)}).values()
  assert reason == "length" and error is None and text.startswith("a")


def test_preemption_keeps_grammars_in_step(tok):
  """A pool too small for all requests preempts and recomputes; outputs still validate."""
  engine = make_engine(tok, num_pages=40, max_num_seqs=4)
  reqs = {f"r{i}": (PROMPTS[i % 5] * 3, constrained(i, max_tokens=60)) for i in range(8)}
  results = run(engine, reqs)
  assert engine.stats().num_preemptions_total > 0
  for rid, (text, reason, error) in results.items():
    assert error is None
    check_output(reqs[rid][1], text, reason)


def test_a_failed_step_rolls_grammars_back_with_the_tokens(tok):
  """The step fails at fetch with the next one in flight; the rolled-back requests are
  recomputed and their grammars stay with the tokens kept."""
  config = dict(max_num_seqs=4, max_model_len=256, page_size=4, num_pages=128)
  fake = FakeRunner(num_pages=128, page_size=4, max_num_seqs=4, vocab_size=V)
  faulty = FaultyRunner(fake, fail_steps=frozenset({3}), fail_at="fetch")
  engine = make_engine(tok, runner=faulty, **config)
  reqs = {f"r{i}": (PROMPTS[i], constrained(i)) for i in range(4)}
  results = run(engine, reqs)
  failed = [rid for rid, (_, reason, _) in results.items() if reason == "error"]
  assert failed, "the injected failure hit no request"
  again = run(make_engine(tok), {rid: reqs[rid] for rid in failed})
  for rid, (text, reason, _) in results.items():
    if rid not in failed:
      check_output(reqs[rid][1], text, reason)
  for rid, (text, reason, _) in again.items():
    check_output(reqs[rid][1], text, reason)


class _MaskIgnoringRunner(FakeRunner):
  """A broken runner: samples constrained rows without their masks."""

  def sample(self, *, handle, masks):
    super().sample(handle=handle, masks={})


def test_a_token_the_grammar_refuses_fails_only_its_request(tok):
  runner = _MaskIgnoringRunner(num_pages=128, page_size=4, max_num_seqs=4, vocab_size=V)
  engine = make_engine(tok, runner=runner)
  results = run(engine, {
      "bad": ("hello", SamplingParams(max_tokens=8, temperature=0.0,
                                      structured_outputs={"choice": ["zzz"]})),
      "ok": ("hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))})
  assert results["bad"][1] == "error" and "violates the output constraint" in results["bad"][2]
  assert results["ok"][1] == "length" and results["ok"][2] is None
  assert engine.health() is None
  alloc = engine.allocator
  assert alloc.num_free == alloc.num_usable


def test_bad_constraints_are_refused_before_the_engine_takes_them(tok):
  engine = make_engine(tok)
  for spec, field in [({"regex": "(("}, "structured_outputs.regex"),
                      ({"json": {"type": 3}}, "structured_outputs.json"),
                      ({"grammar": "start: nope"}, "structured_outputs.grammar")]:
    with pytest.raises(ValueError, match=re.escape(field)):
      engine.add_request("x", "hi", SamplingParams(structured_outputs=spec), lambda o: None)
  assert not engine.has_unfinished()


def test_engines_without_structured_output_refuse_it(tok):
  runner = FakeRunner(num_pages=128, page_size=4, max_num_seqs=4, vocab_size=V)
  engine = LLMEngine(runner=runner, tokenizer=tok, structured_output=False,
                     config=EngineConfig.of(max_num_seqs=4, max_model_len=256, page_size=4,
                                         num_pages=128, compilation_cache=False))
  with pytest.raises(ValueError, match="not supported"):
    engine.add_request("x", "hi", SamplingParams(structured_outputs={"regex": "a"}),
                       lambda o: None)


@pytest.mark.slow
def test_default_model_unconstrained_outputs_do_not_change_when_half_are_constrained(
    default_llm):
  """32 requests, half constrained by a JSON schema: the other half's greedy outputs equal a
  run with no constrained request at all (the real model, f32 weights)."""
  topics = ["cats", "the sea", "Paris", "rain", "music", "a robot", "bread", "winter"]
  prompts = [f"Write one sentence about {t}." for t in topics] * 2
  plain = SamplingParams(max_tokens=12, temperature=0.0)
  json_params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={
      "json": SCHEMA})
  alone = default_llm.generate(prompts, plain)
  mixed = default_llm.generate(prompts + prompts, [plain] * 16 + [json_params] * 16)
  assert [o.token_ids for o in mixed[:16]] == [o.token_ids for o in alone]
  for o in mixed[16:]:
    if o.finish_reason == "stop":
      jsonschema.validate(json.loads(o.text), SCHEMA)
    else:
      assert o.text.startswith("{")


class _FailingSampleRunner(FakeRunner):
  """Its deferred sampling fails, naming the constrained request of the step."""

  def sample(self, *, handle, masks):
    from serving.types import StepError
    if "bad" in handle.pending:
      raise StepError("injected sampling fault", ["bad"])
    super().sample(handle=handle, masks=masks)


def test_a_failed_deferred_sample_fails_only_the_request_it_names(tok):
  runner = _FailingSampleRunner(num_pages=128, page_size=4, max_num_seqs=4, vocab_size=V)
  engine = make_engine(tok, runner=runner)
  results = run(engine, {
      "bad": ("hello", SamplingParams(max_tokens=8, temperature=0.0,
                                      structured_outputs={"choice": ["hey"]})),
      "ok": ("hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))})
  assert results["bad"][1] == "error" and "injected sampling fault" in results["bad"][2]
  assert results["ok"][1] == "length" and results["ok"][2] is None
  assert engine.health() is None
  assert engine.allocator.num_free == engine.allocator.num_usable
