"""LoRA in the engine and scheduler, on the FakeRunner (no jax, milliseconds a test).

The FakeRunner writes KV as (adapter id, token) and checks, for every token,
that the sequence's LoRA slot holds its adapter and that its context holds
KV computed under that adapter. Covered: more adapters than slots (LRU
swaps, requests waiting for a slot while others pass), the prefix cache
never sharing pages across adapters or with the base model, a re-loaded
adapter not inheriting the old one's pages, unloading while requests run,
failed steps forgetting a slot load, and LoraSlots itself.
"""

from __future__ import annotations

import pytest
from frontend_fake import VOCAB, ByteTokenizer
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.lora_slots import LoraSlots
from serving.types import LoraAdapter, SamplingParams

PAGE = 4


def make_engine(*, max_loras=2, max_num_seqs=4, fail_request=None, **kw) -> LLMEngine:
  config = EngineConfig.of(max_num_seqs=max_num_seqs, max_model_len=64, page_size=PAGE,
                        num_pages=64, max_num_batched_tokens=32, compilation_cache=False,
                        max_loras=max_loras, **kw)
  runner = FakeRunner(num_pages=64, page_size=PAGE, max_num_seqs=max_num_seqs,
                      vocab_size=VOCAB)
  if fail_request is not None:
    runner = FaultyRunner(runner, fail_request=fail_request)
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config, model_name="base",
                   lora_loader=lambda path: (8, None))


def expected(prompt: list[int], n: int, lora_id: int = 0) -> list[int]:
  """What the FakeRunner generates under adapter `lora_id` (0: the base model)."""
  return [(prompt[i % len(prompt)] + lora_id) % VOCAB for i in range(n)]


def run(engine, requests, max_tokens=6):
  """requests: [(lora name or None, prompt)] -> token lists, all submitted at once."""
  results = {i: [] for i in range(len(requests))}
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  for i, (lora, prompt) in enumerate(requests):
    engine.add_request(f"q{i}-{id(results)}", prompt, params, results[i].append, lora=lora)
  engine.run_until_idle()
  outs = []
  for i in range(len(requests)):
    assert results[i][-1].finish_reason == "length", results[i][-1].error
    outs.append(sum((o.token_ids for o in results[i]), []))
  return outs


def test_more_adapters_than_slots_each_request_gets_its_own():
  engine = make_engine(max_loras=2)
  ids = {n: engine.load_lora(n, f"/adapters/{n}").lora_id for n in "abcd"}
  requests = [(name, [10 + i, 20 + i, 30 + i]) for i, name in
              enumerate(["a", "b", None, "c", "d", "a", None, "c", "d", "b"] * 2)]
  outs = run(engine, requests)
  for (name, prompt), out in zip(requests, outs, strict=True):
    assert out == expected(prompt, 6, ids[name] if name else 0)
  stats = engine.stats()
  assert stats.lora_swaps_total >= 4  # four adapters through two slots
  assert stats.lora_running == {}
  assert engine.lora_slots.refs == [0, 0]
  assert engine.allocator.num_free == engine.allocator.num_usable


def test_request_waits_for_a_slot_while_others_pass():
  engine = make_engine(max_loras=1, max_num_seqs=4)
  engine.load_lora("a", "/a")
  engine.load_lora("b", "/b")
  params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
  for rid, lora in (("first", "a"), ("blocked", "b"), ("base", None), ("same", "a")):
    engine.add_request(rid, [1, 2, 3], params, lambda out: None, lora=lora)
  engine.step()
  running = {s.request_id for s in engine.scheduler.running}
  assert running == {"first", "base", "same"}  # "b" has no slot: the others pass it
  assert [s.request_id for s in engine.scheduler.waiting] == ["blocked"]
  stats = engine.stats()  # what lora_requests_info reports
  assert (stats.lora_running, stats.lora_waiting, stats.max_lora) == ({"a": 2}, {"b": 1}, 1)
  engine.run_until_idle()
  assert engine.stats().lora_swaps_total == 2
  assert (engine.stats().lora_running, engine.stats().lora_waiting) == ({}, {})


def test_prefix_cache_is_never_shared_across_adapters():
  engine = make_engine(max_loras=2, enable_prefix_caching=True)
  engine.load_lora("a", "/a")
  engine.load_lora("b", "/b")
  prompt = list(range(1, 14))  # three full pages
  hits = []
  for lora in ("a", "b", None, "a", "b", None):
    before = engine.stats().prefix_cache_hits_total
    run(engine, [(lora, prompt)])
    hits.append(engine.stats().prefix_cache_hits_total - before)
  # The first run of each adapter (and of the base) finds nothing; the second finds its own.
  assert hits[:3] == [0, 0, 0]
  assert all(h == 12 for h in hits[3:])


def test_reloaded_adapter_does_not_inherit_pages():
  engine = make_engine(max_loras=1, enable_prefix_caching=True)
  old = engine.load_lora("a", "/a")
  prompt = list(range(1, 14))
  run(engine, [("a", prompt)])
  engine.remove_lora("a")
  new = engine.load_lora("a", "/a2")
  assert new.lora_id != old.lora_id
  before = engine.stats().prefix_cache_hits_total
  assert run(engine, [("a", prompt)]) == [expected(prompt, 6, new.lora_id)]
  assert engine.stats().prefix_cache_hits_total == before


def test_unload_while_running_finishes_running_requests():
  engine = make_engine(max_loras=1)
  adapter = engine.load_lora("a", "/a")
  outs = []
  engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True), outs.append, lora="a")
  engine.step()
  engine.remove_lora("a")
  with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
    engine.add_request("late", [1], SamplingParams(max_tokens=2), outs.append, lora="a")
  engine.run_until_idle()
  assert sum((o.token_ids for o in outs), []) == expected([5, 6, 7], 12, adapter.lora_id)
  assert [a.name for a in engine.list_loras()] == []


def test_registration_errors():
  engine = make_engine(max_loras=1)
  engine.load_lora("a", "/a")
  with pytest.raises(ValueError, match="already loaded"):
    engine.load_lora("a", "/other")
  with pytest.raises(ValueError, match="differ from the base"):
    engine.load_lora("base", "/x")
  with pytest.raises(KeyError):
    engine.remove_lora("missing")
  with pytest.raises(ValueError, match="no LoRA adapter named 'zz'"):
    engine.add_request("r", [1], SamplingParams(), lambda o: None, lora="zz")
  off = make_engine(max_loras=0)
  with pytest.raises(ValueError, match="not enabled"):
    off.add_lora("a", "/a", 8, None)


def test_failed_step_forgets_the_slot_load_and_fails_only_its_request():
  # The NUL-first request's step fails: its adapter's load may never have happened.
  engine = make_engine(max_loras=1, fail_request=lambda seq: seq.prompt_ids[0] == 0)
  a = engine.load_lora("a", "/a")
  outs = {}
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  for rid, prompt in (("bad", [0, 1, 2]), ("good", [3, 4, 5])):
    outs[rid] = []
    engine.add_request(rid, prompt, params, outs[rid].append, lora="a")
  engine.run_until_idle()
  assert outs["bad"][-1].finish_reason == "error"
  assert sum((o.token_ids for o in outs["good"]), []) == expected([3, 4, 5], 4, a.lora_id)
  assert engine.lora_slots.refs == [0]
  assert engine.stats().lora_swaps_total >= 1


def test_lora_slots_lru():
  slots = LoraSlots(2)
  a, b, c = (LoraAdapter(name=n, lora_id=i, path=n, rank=4) for i, n in enumerate("abc", 1))
  assert slots.acquire(a) == 0 and slots.acquire(b) == 1
  assert slots.take_loads() == [(0, a), (1, b)]
  assert slots.acquire(c) is None  # both pinned
  slots.release(0)
  assert slots.acquire(b) == 1 and slots.take_loads() == []  # resident: no load
  assert slots.acquire(c) == 0  # evicts a, the only idle slot
  slots.release(1)
  slots.release(1)
  slots.release(0)
  assert slots.acquire(a) == 1  # b (used before c) is the least recently used
  assert slots.take_loads() == [(0, c), (1, a)]
  assert slots.num_swaps == 4
  with pytest.raises(AssertionError):
    slots.release(0)
