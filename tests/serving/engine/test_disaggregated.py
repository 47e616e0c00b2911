"""Disaggregated prefill / decode (serving/engine/disaggregated.py) over fake engines.

Real `LLMEngine`s on `FakeRunner`s, whose KV pool holds token ids and is read
back before every token: a page exported from the wrong place, imported into
the wrong place, or missing on the decode side, fails the run. Checked:
- prompts of one page or more are prefilled on the prefill engine, their
  pages moved in chunks, and only the last partial page is computed on the
  decode engine; shorter prompts are prefilled by the decode engine; the
  output equals one engine's;
- after completions and after aborts (before, during and after the
  transfer) no page on either side is still referenced;
- a prefill worker killed mid-transfer fails that request alone with an
  error, leaves the decode side nothing referenced, and the pair goes on
  serving (the decode engine prefills for itself); a failed import fails
  only its request;
- the same while both engines run their own threads.
"""

from __future__ import annotations

import threading

import pytest
from frontend_fake import VOCAB, ByteTokenizer, wait_for
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.disaggregated import DisaggregatedEngine
from serving.engine.fake_runner import FakeRunner
from serving.types import SamplingParams

PAGE = 4
CONFIG = dict(max_num_seqs=4, max_model_len=128, page_size=PAGE, num_pages=96,
              max_num_batched_tokens=64, kv_transfer_pages=2)


def _engine(config: EngineConfig, **faults) -> LLMEngine:
  runner = FakeRunner(num_pages=config.cache.num_pages, page_size=config.cache.page_size,
                      max_num_seqs=config.scheduler.max_num_seqs, vocab_size=VOCAB)
  return LLMEngine(runner=FaultyRunner(runner, **faults), tokenizer=ByteTokenizer(),
                   config=config, model_name="fake")


def pair(prefill_faults=None, decode_faults=None, decode_workers=1) -> DisaggregatedEngine:
  config = EngineConfig.of(**CONFIG)
  return DisaggregatedEngine([_engine(config, **(prefill_faults or {}))],
                             [_engine(config, **(decode_faults or {}))
                              for _ in range(decode_workers)], config=config)


def expected(prompt: list[int], n: int) -> list[int]:
  """FakeRunner's tokens: output i is prompt token i mod len (as read from the KV)."""
  return [prompt[i % len(prompt)] for i in range(n)]


def submit(engine, prompts: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list]:
  outs = {rid: [] for rid in prompts}
  for rid, prompt in prompts.items():
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       outs[rid].append)
  return outs


def tokens(outs: list) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def referenced(engine: LLMEngine) -> list[int]:
  engine.allocator.check()
  return [p for p in range(1, engine.allocator.num_pages) if engine.allocator.refcount(p)]


def assert_nothing_held(pd: DisaggregatedEngine) -> None:
  """No page referenced on any live engine (a dead one's device state is gone)."""
  for e in pd.engines:
    if e.dead is None:
      assert referenced(e) == [], e


PROMPTS = {"short": [7, 8, 9],  # under one page: the decode engine prefills it
           "one": list(range(10, 15)),  # one full page (+1 token)
           "five": list(range(20, 42)),  # 5 full pages: three chunks of <= 2
           "again": list(range(20, 42)) + [99]}  # shares "five"'s pages


def test_prompts_move_from_prefill_to_decode():
  pd = pair()
  outs = submit(pd, PROMPTS)
  pd.run_until_idle()
  for rid, prompt in PROMPTS.items():
    assert tokens(outs[rid]) == expected(prompt, 6), rid
    assert outs[rid][-1].finish_reason == "length"
  assert pd.transfers_total == 3
  prefill, decode = pd.prefill[0].stats(), pd.decode[0].stats()
  assert prefill.prompt_tokens_total == 5 + 22 + 23  # "short" never went there
  # The decode engine computed "short" whole and only the partial last page of the others.
  assert decode.prefill_tokens_computed_total == 3 + 1 + 2 + 3
  assert_nothing_held(pd)


def test_aborts_at_every_stage_hold_nothing():
  pd = pair()
  prompt = list(range(30, 52))
  outs = submit(pd, {"a": prompt, "b": prompt + [1], "c": prompt + [2]}, max_tokens=20)
  pd.abort("a")  # still waiting for its prefill
  while pd._owner.get("b") is None or getattr(pd._owner["b"], "stage", "") != "transfer":
    pd.step()
  pd.abort("b")  # between transfer chunks
  pd.run_until_idle()
  assert outs["a"][-1].finish_reason == "abort"
  assert outs["b"][-1].finish_reason == "abort"
  assert tokens(outs["c"]) == expected(prompt + [2], 20)
  assert_nothing_held(pd)
  # Aborted while decoding (after the transfer): its pages go back as well.
  outs = submit(pd, {"d": prompt + [3]}, max_tokens=50)
  while len(tokens(outs["d"])) < 3:
    pd.step()
  pd.abort("d")
  pd.run_until_idle()
  assert outs["d"][-1].finish_reason == "abort"
  assert_nothing_held(pd)


def test_prefill_worker_killed_mid_transfer():
  pd = pair(prefill_faults=dict(dead_export_from=1))  # the second chunk's export
  prompt = list(range(40, 62))  # 5 full pages: 3 chunks
  outs = submit(pd, {"victim": prompt})
  pd.run_until_idle()
  last = outs["victim"][-1]
  assert last.finish_reason == "error" and "prefill worker" in last.error
  assert pd.transfer_failures_total == 1
  assert_nothing_held(pd)  # the decode side's first chunk was released (still valid cache)
  assert pd.health() is None and "prefill 0" in pd.dead_workers()
  # The pair keeps serving: the decode engine prefills for itself now.
  outs = submit(pd, {"after": prompt + [5], "other": [1, 2, 3, 4, 5, 6]})
  pd.run_until_idle()
  assert tokens(outs["after"]) == expected(prompt + [5], 6)
  assert tokens(outs["other"]) == expected([1, 2, 3, 4, 5, 6], 6)
  assert_nothing_held(pd)


def test_failed_import_fails_only_its_request():
  pd = pair(decode_faults=dict(fail_imports=frozenset({1})))
  outs = submit(pd, {"first": list(range(50, 72))})
  pd.run_until_idle()
  assert outs["first"][-1].finish_reason == "error"
  assert "decode worker 0" in outs["first"][-1].error
  assert_nothing_held(pd)
  outs = submit(pd, {"next": list(range(50, 72)) + [9]})
  pd.run_until_idle()
  assert tokens(outs["next"]) == expected(list(range(50, 72)) + [9], 6)
  assert pd.health() is None and pd.dead_workers() == {}
  assert_nothing_held(pd)


def test_engine_threads_and_two_decode_workers():
  pd = pair(decode_workers=2)
  pd.start()
  try:
    done = threading.Event()
    prompts = {f"r{i}": [i + 1] * (3 + 5 * i) for i in range(8)}
    outs = {rid: [] for rid in prompts}

    def on_output(rid):
      def cb(out):
        outs[rid].append(out)
        if all(o and o[-1].finished for o in outs.values()):
          done.set()
      return cb

    for rid, prompt in prompts.items():
      pd.add_request(rid, prompt, SamplingParams(max_tokens=5, ignore_eos=True), on_output(rid))
    assert done.wait(30)
    for rid, prompt in prompts.items():
      assert tokens(outs[rid]) == expected(prompt, 5), rid
    assert sorted(pd.router.routed) == [4, 4]
    assert wait_for(lambda: not pd.has_unfinished())
  finally:
    pd.shutdown()
  assert_nothing_held(pd)


def test_invalid_requests_are_refused_before_any_work():
  pd = pair()
  with pytest.raises(ValueError, match="maximum context length"):
    pd.add_request("x", list(range(1, 200)), SamplingParams(max_tokens=4), lambda o: None)
  with pytest.raises(ValueError, match="duplicate request id"):
    submit(pd, {"d": [1, 2, 3, 4, 5, 6]})
    submit(pd, {"d": [1, 2, 3, 4, 5, 6]})
  pd.run_until_idle()
  assert not pd.has_unfinished()
  assert_nothing_held(pd)


def test_config_needs_both_roles():
  with pytest.raises(ValueError, match="both prefill_workers"):
    EngineConfig.of(prefill_workers=1)
  with pytest.raises(ValueError, match="replace dp"):
    EngineConfig.of(prefill_workers=1, decode_workers=1, dp=2)


def test_requests_that_skip_the_prefix_cache_are_prefilled_by_the_decode_engine():
  pd = pair()
  outs = []
  prompt = list(range(60, 80))
  pd.add_request("pen", prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                               repetition_penalty=1.2), outs.append)
  pd.run_until_idle()
  assert tokens(outs) == expected(prompt, 4)
  assert pd.transfers_total == 0 and pd.prefill[0].stats().prompt_tokens_total == 0
  assert_nothing_held(pd)
