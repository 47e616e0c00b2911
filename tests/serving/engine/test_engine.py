"""The engine loop and scheduler, end to end on a tiny model.

- A seeded randomized workload (staggered arrivals, prompts longer than a
  chunk, mixed max_tokens, aborts, a page pool small enough to force
  preemption) gives every request exactly the tokens it gets when run alone.
- The allocator's invariants hold after every step; pages are shared only
  through the prefix cache; at the end every page is free and unreferenced.
- Nothing compiles after warm-up: a fresh engine, watched from the end of its
  warm-up, runs that same kind of workload (preemption, aborts, prefix-cache
  hits, chunked prefill) with every kind of sampling parameter, with and
  without speculative decoding.
- A shared system prompt hits the prefix cache and skips that prefill.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_watch import compile_events
from tiers import fast_first

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.entrypoints.engine_builder import build_engine
from serving.runner.model_runner import StepHandle
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model

MAX_LEN = 96


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_llama"))
  save_tiny_model("llama", path)
  return path


def make_engine(path, **kw) -> LLMEngine:
  base = dict(max_num_seqs=4, max_model_len=MAX_LEN, page_size=8, num_pages=24,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return build_engine(path, EngineConfig.of(**{**base, **kw}))


@pytest.fixture(scope="module")
def engine(tiny_dir):
  return make_engine(tiny_dir)


def run_alone(engine, prompt, params):
  outs = []
  engine.add_request("alone", prompt, params, outs.append)
  engine.run_until_idle()
  return sum((o.token_ids for o in outs), [])


def check_pages(engine):
  """Allocator invariants + no page shared by two requests unless prefix-cached."""
  alloc = engine.allocator
  alloc.check()
  owners = collections.Counter(p for s in engine.scheduler.running for p in s.pages)
  for page, n in owners.items():
    assert alloc.refcount(page) >= n
    if n > 1:
      assert page in alloc._hash_of, f"page {page} shared by {n} requests without the cache"


# Every sampling path: greedy, top-p, top-k + min-p, penalties + logprobs, stop strings, ...
SAMPLING_VARIANTS = [
    SamplingParams(max_tokens=5, temperature=0.0),
    SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(max_tokens=3, temperature=1.2, top_k=5, min_p=0.05),
    SamplingParams(max_tokens=6, temperature=0.5, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.3, logprobs=5),
    SamplingParams(max_tokens=9, temperature=0.0, stop=["a"], logprobs=0),
    SamplingParams(max_tokens=4, temperature=0.9, top_k=100, top_p=0.5),
]


# Constrained output: the step's sampling waits for token masks (no other program).
CONSTRAINED_VARIANTS = [
    SamplingParams(max_tokens=6, temperature=0.8, seed=5,
                   structured_outputs={"regex": "[a-z]+( [a-z]+)*"}),
    SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"json_object": True}),
]


def random_workload(rng, n, variants=None):
  """`n` requests: staggered arrivals, prompts up to 60 tokens (longer than a prefill chunk),
  every third one behind a shared 24-token prefix, mixed max_tokens, every fifth-ish aborted.
  Sampling: greedy or temperature 0.8 (seeded); or, with `variants`, request i takes
  `variants[i % len(variants)]` with its own max_tokens."""
  shared = rng.integers(0, VOCAB, 24).tolist()
  reqs = []
  for i in range(n):
    plen = int(rng.integers(1, 60))
    prompt = rng.integers(0, VOCAB, plen).tolist()
    if i % 3 == 0:
      prompt = shared + prompt[:20]
    max_tokens = int(rng.integers(1, min(30, MAX_LEN - len(prompt)) + 1))
    if variants:
      params = dataclasses.replace(variants[i % len(variants)], max_tokens=max_tokens)
    else:
      sampled = i % 4 == 1
      params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                              temperature=0.8 if sampled else 0.0, seed=1000 + i)
    arrival = int(rng.integers(0, 25))
    abort_at = arrival + int(rng.integers(1, 8)) if i % 5 == 2 else None
    reqs.append(dict(id=f"q{i}", prompt=prompt, params=params, arrival=arrival,
                     abort_at=abort_at))
  return reqs


def drive(engine, reqs, max_steps=400):
  """Adds each request at its arrival step (aborting at `abort_at`) and steps the engine,
  checking the page invariants after every step, until all are done; returns
  {request id: [outputs]}."""
  results = {r["id"]: [] for r in reqs}
  last_arrival = max(r["arrival"] for r in reqs)
  for step in range(max_steps):
    for r in reqs:
      if r["arrival"] == step:
        engine.add_request(r["id"], r["prompt"], r["params"], results[r["id"]].append)
      if r["abort_at"] == step:
        engine.abort(r["id"])
    if step > last_arrival and not engine.has_unfinished():
      break
    engine.step()
    check_pages(engine)
  assert not engine.has_unfinished()
  return results


def test_randomized_workload_matches_alone(engine):
  rng = np.random.default_rng(1234)
  reqs = random_workload(rng, 14)
  alone = {r["id"]: run_alone(engine, r["prompt"], r["params"]) for r in reqs}
  preemptions_before = engine.scheduler.num_preemptions
  results = drive(engine, reqs)
  for r in reqs:
    outs = results[r["id"]]
    tokens = sum((o.token_ids for o in outs), [])
    reason = outs[-1].finish_reason
    if reason == "abort":
      assert tokens == alone[r["id"]][:len(tokens)], r["id"]
    else:
      assert reason == "length"
      assert tokens == alone[r["id"]], r["id"]
  assert engine.scheduler.num_preemptions > preemptions_before, "pool too big: no preemption"
  assert any(outs[-1].finish_reason == "abort" for outs in results.values())
  alloc = engine.allocator
  alloc.check()
  assert alloc.num_free == alloc.num_usable
  assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
  assert not engine.scheduler.running and not engine.scheduler.waiting


# Speculation: off, and a draft model (the model itself, so drafts are kept and every
# verify bucket runs; n-gram and suffix use the same verify programs, minus the draft's);
# and multi-step decoding, whose programs serve the small batches between arrivals.
SPECULATION = {"off": {}, "draft": dict(speculative_method="draft", num_speculative_tokens=3),
               "multi-step": dict(num_decode_steps=3, decode_steps_max_batch=4)}


@pytest.mark.parametrize("speculation", fast_first(sorted(SPECULATION), fast=("off", "multi-step")))
def test_no_compilation_after_warm_up(tiny_dir, speculation):
  """A fresh engine, watched from the end of its warm-up (no earlier test has run anything
  on it), with a pool small enough to force preemption and the prefix cache on."""
  jax.clear_caches()  # nothing jitted by earlier tests can stand in for this warm-up
  spec = dict(SPECULATION[speculation])
  if spec.get("speculative_method") == "draft":
    spec["speculative_model"] = tiny_dir
  eng = make_engine(tiny_dir, num_pages=16, enable_prefix_caching=True, **spec)
  multi_steps = []
  if "num_decode_steps" in spec:  # count its multi-step calls
    run = eng.runner.run_multi_decode
    eng.runner.run_multi_decode = lambda *a: multi_steps.append(1) or run(*a)
  with compile_events() as events:
    reqs = random_workload(np.random.default_rng(7), 18,
                           variants=SAMPLING_VARIANTS + CONSTRAINED_VARIANTS)
    results = drive(eng, reqs)
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  # The workload had what it is meant to cover.
  assert bool(multi_steps) == ("num_decode_steps" in spec)
  stats = eng.stats()
  assert stats.num_preemptions_total > 0, "pool too big: no preemption"
  assert stats.prefix_cache_hits_total > 0, "no prefix-cache hit"
  assert any(outs and outs[-1].finish_reason == "abort" for outs in results.values())
  assert any(len(r["prompt"]) > eng.config.scheduler.max_num_batched_tokens for r in reqs)
  assert len({r["params"].max_tokens for r in reqs}) > 1
  assert len({r["arrival"] for r in reqs}) > 1
  assert any(r["params"].structured_outputs for r in reqs)
  if "speculative_method" in spec:
    assert stats.spec_decode.num_accepted_tokens > 0


def test_prefix_cache_skips_shared_prefill(tiny_dir, engine):
  rng = np.random.default_rng(3)
  system = rng.integers(0, VOCAB, 40).tolist()
  prompts = [system + rng.integers(0, VOCAB, 5).tolist() for _ in range(3)]
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  before = engine.stats()
  cached = [run_alone(engine, p, params) for p in prompts]
  after = engine.stats()
  hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
  computed = after.prefill_tokens_computed_total - before.prefill_tokens_computed_total
  assert hits >= 2 * 40  # the 2nd and 3rd requests reuse 5 full pages
  assert computed == sum(len(p) for p in prompts) - hits
  plain = make_engine(tiny_dir, enable_prefix_caching=False)
  assert [run_alone(plain, p, params) for p in prompts] == cached
  assert plain.stats().prefix_cache_hits_total == 0


def test_a_step_that_samples_nothing_is_waited_for(engine):
  """A prompt of several chunks: its middle chunks sample nothing, yet `fetch` waits for
  them (their last output, `StepHandle.done`). The engine dispatches a step, then fetches
  the one before, so at most two steps are on the device (before: every chunk of a long
  prompt was queued at once, a later request's decode waited behind all of them, and
  their sum counted as one step against `step_timeout_s`: a 4,096-token prompt of a 1B
  K-quant model marked the engine wedged)."""
  runner, handles = engine.runner, []
  dispatch = runner.run
  runner.run = lambda inputs: handles.append(dispatch(inputs)) or handles[-1]
  try:
    prompt = list(range(3, 3 + 2 * engine.config.scheduler.max_num_batched_tokens + 20))
    run_alone(engine, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
  finally:
    del runner.run
  quiet = [h for h in handles if not h.calls]
  assert len(quiet) >= 2 and all(h.done is not None for h in quiet)
  # fetch returns only once such a step has run: here a step whose output takes a while
  step = jax.jit(lambda a: functools.reduce(lambda x, _: jnp.tanh(x @ a), range(24), a))
  a = jnp.full((1024, 1024), 1e-3, jnp.float32)
  step(a).block_until_ready()  # compiled
  out = step(a)
  assert runner.fetch(handle=StepHandle(calls=[], logprobs={}, done=out)).tokens == {}
  assert out.is_ready()


def test_bad_requests_are_rejected(engine):
  cb = lambda o: None
  with pytest.raises(ValueError, match="empty"):
    engine.add_request("e1", [], SamplingParams(), cb)
  with pytest.raises(ValueError, match="maximum context length"):
    engine.add_request("e2", [1] * MAX_LEN, SamplingParams(max_tokens=1), cb)
  with pytest.raises(ValueError, match="exceeds"):
    engine.add_request("e3", [1] * 10, SamplingParams(max_tokens=MAX_LEN), cb)
  with pytest.raises(ValueError, match="token ids"):
    engine.add_request("e4", [VOCAB + 5], SamplingParams(), cb)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible(engine):
  params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
  prompt = list(range(10, 30))
  first = run_alone(engine, prompt, params)
  results = {i: [] for i in range(3)}
  for i in range(3):  # batched with other requests this time
    p = params if i == 1 else SamplingParams(max_tokens=12, temperature=1.0, seed=i)
    engine.add_request(f"s{i}", prompt, p, results[i].append)
  engine.run_until_idle()
  assert sum((o.token_ids for o in results[1]), []) == first
