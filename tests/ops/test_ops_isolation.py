"""Tenant isolation: a request never reads KV pages (or slot state) it does not own.

In-process, on a tiny random Llama (tests/tiny_models.py). The same batch of
requests runs twice with the same schedule: once plainly, once with every KV
page that no running request owns (free pages, pages of finished or
preempted requests and the dummy page 0, in every layer) overwritten with NaN
before every engine step, and the state of every free decode slot (last
token, penalty counters) overwritten with garbage. If any attention read, or
the sampler, touched a page or slot it does not own, NaN or the garbage
would reach its logits; the outputs must instead be identical, token for
token and logprob for logprob, and finite. The pool is small enough that
requests are preempted and recomputed on the way.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from serving.types import SamplingParams

pytestmark = pytest.mark.slow  # real engines probed for cross-tenant reads

PROMPTS = [list(range(40, 45)), list(range(60, 77)), list(range(80, 113)), list(range(120, 160)),
           list(range(200, 223)), list(range(30, 37))]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  from serving import LLM
  from tiny_models import save_tiny_model

  path = str(tmp_path_factory.mktemp("tiny") / "llama")
  save_tiny_model("llama", path)
  return LLM(path, max_num_seqs=4, max_model_len=128, page_size=16, num_pages=12,
             max_num_batched_tokens=32, enable_prefix_caching=False, dtype="float32",
             attention_block_tokens=32)


def poison_unowned(engine) -> int:
  """NaN into every page no running request owns; garbage into free slots. Returns #pages."""
  runner, sched = engine.runner, engine.scheduler
  owned = {p for s in sched.running for p in s.pages}
  unowned = np.array([p for p in range(runner.num_pages) if p not in owned], np.int32)
  layers = np.arange(engine.runner.model_cfg.num_layers, dtype=np.int32)
  rows = (layers[:, None] * runner.num_pages + unowned[None, :]).ravel()
  st = runner.state
  kv = dataclasses.replace(st.kv, k=st.kv.k.at[rows].set(jnp.nan),
                           v=st.kv.v.at[rows].set(jnp.nan))
  dummy_slot = engine.config.scheduler.max_num_seqs
  free = np.array(sched.free_slots + [dummy_slot], np.int32)
  vocab = engine.runner.model_cfg.vocab_size
  runner.state = dataclasses.replace(
      st, kv=kv, last_tokens=st.last_tokens.at[free].set(vocab - 1),
      prompt_mask=st.prompt_mask.at[free].set(True),
      output_counts=st.output_counts.at[free].set(1000))
  return len(unowned)


def run_batch(engine, poison: bool) -> tuple[dict, int]:
  """Runs PROMPTS together, stepping by hand; returns outputs by id and #preemptions."""
  outs: dict[str, list] = {}
  for i, prompt in enumerate(PROMPTS):
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, ignore_eos=True,
                            repetition_penalty=1.3 if i % 2 else 1.0)
    engine.add_request(f"r{i}", prompt, params, outs.setdefault(f"r{i}", []).append)
  preempted_before = engine.scheduler.num_preemptions
  while engine.has_unfinished():
    if poison:
      poison_unowned(engine)
    engine.step()
  result = {}
  for rid, deltas in outs.items():
    ids = [t for d in deltas for t in d.token_ids]
    lps = [(lp.token_id, lp.logprob, *[v for pair in lp.top for v in pair])
           for d in deltas for lp in d.logprobs or []]
    result[rid] = (ids, np.array(lps, np.float64), deltas[-1].finish_reason)
  return result, engine.scheduler.num_preemptions - preempted_before


def test_unowned_pages_and_slots_are_never_read(llm):
  engine = llm.engine
  clean, preempted_clean = run_batch(engine, poison=False)
  poisoned, preempted_poisoned = run_batch(engine, poison=True)
  assert preempted_clean == preempted_poisoned > 0  # same schedule, with recomputation
  for rid, (ids, lps, finish) in clean.items():
    p_ids, p_lps, p_finish = poisoned[rid]
    assert finish == p_finish == "length" and len(ids) == 40
    assert p_ids == ids, rid
    assert np.isfinite(p_lps).all(), rid
    np.testing.assert_array_equal(p_lps, lps, err_msg=rid)
  engine.allocator.check()
  assert engine.allocator.num_free == engine.allocator.num_usable


def test_poison_reaches_the_pages_it_should(llm):
  """The probe itself: NaN in a page the request does own does corrupt that request."""
  engine = llm.engine
  params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
  deltas: list = []
  engine.add_request("victim", PROMPTS[3], params, deltas.append)
  while not engine.scheduler.running or engine.scheduler.running[0].in_prefill:
    engine.step()
  seq = engine.scheduler.running[0]
  rows = np.array([layer * engine.runner.num_pages + seq.pages[0]
                   for layer in range(engine.runner.model_cfg.num_layers)], np.int32)
  st = engine.runner.state
  engine.runner.state = dataclasses.replace(st, kv=dataclasses.replace(
      st.kv, k=st.kv.k.at[rows].set(jnp.nan), v=st.kv.v.at[rows].set(jnp.nan)))
  engine.run_until_idle()
  logprobs = [lp.logprob for d in deltas for lp in d.logprobs or []]
  assert len(logprobs) == 8 and not np.isfinite(logprobs[-1])
