"""Data parallel replicas (serving/engine/replicas.py) over fake engines, no jax.

- The router: least loaded for unrelated prompts, the replica holding the
  longest prefix within the balance slack, dead replicas skipped, forgotten
  blocks beyond the replica's pages.
- `ReplicatedEngine` over real `LLMEngine`s on `FakeRunner`s (which check every
  KV read): a burst spreads evenly and every request gets its own tokens; a
  shared-prefix workload keeps each prefix on one replica and gets the prefix
  hits one engine would; aborts reach the owning replica; a request that fails
  validation leaves no load behind; a dead replica is named by `health()` and
  skipped by the router; LoRA adapters load on every replica.
"""

import threading

import pytest
from frontend_fake import fake_engine

from serving.config import EngineConfig
from serving.engine.llm_engine import EngineDeadError
from serving.engine.replicas import ReplicaRouter, ReplicatedEngine, merge_stats
from serving.types import SamplingParams

PAGE = 4


def router(n=2, slack=2, max_blocks=100) -> ReplicaRouter:
  return ReplicaRouter(n, PAGE, balance_slack=slack, max_blocks=max_blocks)


def admit(r: ReplicaRouter, ids, loads, live=None) -> int:
  route = r.choose(ids, loads, live or [True] * r.num_replicas)
  r.record(route)
  return route.replica


def test_unrelated_prompts_go_to_the_least_loaded_replica():
  r = router(3)
  loads = [0, 0, 0]
  picks = []
  for i in range(6):
    picks.append(admit(r, [i] * 3, loads))  # shorter than a page: no prefix to follow
    loads[picks[-1]] += 1
  assert picks == [0, 1, 2, 0, 1, 2]
  assert admit(r, [99] * 8, [5, 1, 3]) == 1


def test_a_held_prefix_wins_within_the_slack():
  r = router(2, slack=2)
  prefix = list(range(16))  # four pages
  assert admit(r, prefix + [100], [0, 0]) == 0
  assert admit(r, prefix + [101], [1, 0]) == 0  # held there, 1 above the least: within slack
  assert admit(r, prefix[:8] + [7, 7, 7, 7], [2, 0]) == 0  # two pages of it still match
  assert admit(r, prefix + [102], [3, 0]) == 1  # 3 above: too uneven, least loaded
  # now both hold it: the less loaded of the two
  assert admit(r, prefix + [103], [3, 1]) == 1
  assert r.prefix_routed == 3


def test_the_longest_held_prefix_is_preferred():
  r = router(2, slack=8)
  a = list(range(40, 56))  # four pages
  assert admit(r, a[:8] + [1] * 8, [0, 0]) == 0  # replica 0 holds two pages of `a`
  assert admit(r, a, [9, 0]) == 1  # too uneven for replica 0: replica 1 holds all four
  assert admit(r, a + [3], [0, 0]) == 1


def test_dead_replicas_are_skipped_and_all_dead_raises():
  r = router(2)
  prefix = list(range(8))
  admit(r, prefix, [0, 0])
  assert admit(r, prefix, [0, 0], live=[False, True]) == 1
  with pytest.raises(EngineDeadError):
    r.choose(prefix, [0, 0], [False, False])


def test_blocks_beyond_the_replica_pages_are_forgotten():
  r = router(2, slack=100, max_blocks=2)
  first = list(range(8))
  admit(r, first, [0, 0])
  admit(r, list(range(100, 112)), [0, 1])  # three more pages on replica 0 push `first` out
  assert r.held_blocks(0, r.block_hashes(first)) == 0
  assert admit(r, first, [1, 0]) == 1


def test_merge_stats_sums_and_weights_usage_by_pages():
  a = fake_engine(max_num_seqs=2, max_model_len=64, page_size=PAGE, num_pages=17).stats()
  b = fake_engine(max_num_seqs=2, max_model_len=64, page_size=PAGE, num_pages=33).stats()
  m = merge_stats([a, b])
  assert m.num_pages_total == a.num_pages_total + b.num_pages_total == 48
  assert m.num_pages_free == 48 and m.kv_cache_usage == 0.0
  assert (m.page_size, m.max_lora) == (PAGE, 0)  # per-engine settings, not summed
  a.lora_waiting, b.lora_waiting, b.max_lora = {"x": 1}, {"x": 2, "y": 1}, 2
  assert (merge_stats([a, b]).lora_waiting, merge_stats([a, b]).max_lora) == ({"x": 3, "y": 1}, 2)


# ---- ReplicatedEngine over fake engines ----

def replicated(n=2, slots=4, pages=64, step_s=0.0, **kw) -> ReplicatedEngine:
  config = EngineConfig.of(max_num_seqs=slots, max_model_len=128, page_size=PAGE, num_pages=pages,
                        compilation_cache=False, **kw)
  engines = [fake_engine(config, step_s=step_s) for _ in range(n)]
  return ReplicatedEngine(engines, config=EngineConfig.of(
      max_num_seqs=slots, max_model_len=128, page_size=PAGE, num_pages=pages, dp=n,
      compilation_cache=False, **kw))


def greedy(n: int) -> SamplingParams:
  return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def collect(engine, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
  outs = {rid: [] for rid in prompts}
  for rid, ids in prompts.items():
    engine.add_request(rid, ids, greedy(n), lambda o, rid=rid: outs[rid].extend(o.token_ids))
  engine.run_until_idle()
  return outs


def expected(prompt: list[int], n: int) -> list[int]:
  """FakeRunner's tokens: output i is prompt token i % len(prompt)."""
  return [prompt[i % len(prompt)] for i in range(n)]


def test_a_burst_spreads_evenly_and_every_request_gets_its_tokens():
  engine = replicated(n=2, slots=4)
  prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] for i in range(16)}
  outs = collect(engine, prompts, 6)
  assert all(outs[rid] == expected(p, 6) for rid, p in prompts.items())
  assert engine.router.routed == [8, 8]
  per_replica = [s.generation_tokens_total for s in engine.replica_stats()]
  assert per_replica == [48, 48] and engine.stats().generation_tokens_total == 96
  assert engine._loads == [0, 0] and engine.replica_of("r0") is None
  assert engine.num_slots == 8


def test_shared_prefixes_stay_on_one_replica_with_one_engines_hits():
  prefixes = [[50 + k] * 16 for k in range(4)]  # four prefixes of four pages each
  prompts = {f"p{k}-{j}": prefixes[k] + [100 + j, 101 + j] for j in range(6) for k in range(4)}
  single = replicated(n=1, slots=8, pages=128)
  collect(single, prompts, 4)
  engine = replicated(n=2, slots=4, pages=64)
  outs = collect(engine, prompts, 4)
  assert all(outs[rid] == expected(p, 4) for rid, p in prompts.items())
  hits = engine.stats().prefix_cache_hits_total
  assert hits >= 0.9 * single.stats().prefix_cache_hits_total > 0
  assert engine.router.routed == [12, 12]  # and still balanced


def test_abort_reaches_the_owning_replica():
  engine = replicated(n=2, slots=2, step_s=0.01)
  engine.start()
  try:
    done = {}
    events = {rid: threading.Event() for rid in ("a", "b")}

    def on(rid):
      def cb(out):
        if out.finished:
          done[rid] = out.finish_reason
          events[rid].set()
      return cb

    engine.add_request("a", [5, 6, 7], greedy(100), on("a"))
    engine.add_request("b", [8, 9, 10], greedy(100), on("b"))
    assert {engine.replica_of("a"), engine.replica_of("b")} == {0, 1}
    engine.abort("b")
    assert events["b"].wait(5) and done["b"] == "abort"
    engine.abort("a")
    assert events["a"].wait(5) and done["a"] == "abort"
    assert engine._loads == [0, 0]
  finally:
    engine.shutdown()


def test_a_refused_request_leaves_no_load_or_route():
  engine = replicated(n=2)
  with pytest.raises(ValueError, match="maximum context length"):
    engine.add_request("long", list(range(3, 200)), greedy(4), lambda o: None)
  with pytest.raises(ValueError, match="empty"):
    engine.add_request("empty", [], greedy(4), lambda o: None)
  assert engine._loads == [0, 0] and engine.router.routed == [0, 0]
  engine.add_request("dup", [3, 4], greedy(50), lambda o: None)
  with pytest.raises(ValueError, match="duplicate"):
    engine.add_request("dup", [3, 4], greedy(50), lambda o: None)
  assert engine._loads in ([1, 0], [0, 1]) and sum(engine.router.routed) == 1
  engine.run_until_idle()
  assert engine._loads == [0, 0]


def wait_all(engine, prompts: dict[str, list[int]], n: int) -> dict[str, tuple[list, str]]:
  """Submits to a started engine; waits for every request; (tokens, finish reason) each."""
  outs = {rid: ([], []) for rid in prompts}
  left = threading.Semaphore(0)

  def on(rid):
    def cb(out):
      outs[rid][0].extend(out.token_ids)
      if out.finished:
        outs[rid][1].append(out.finish_reason)
        left.release()
    return cb

  for rid, ids in prompts.items():
    engine.add_request(rid, ids, greedy(n), on(rid))
  assert all(left.acquire(timeout=5) for _ in prompts)
  return {rid: (toks, reason[0]) for rid, (toks, reason) in outs.items()}


def test_a_dead_replica_is_named_and_skipped():
  engine = replicated(n=2, slots=2)
  engine.start()
  try:
    # first byte 1: the FaultyRunner loses its device on this request's step
    assert wait_all(engine, {"kill": [1, 2, 3]}, 4)["kill"] == ([], "error")
    reason = engine.health()
    assert reason is not None and reason.startswith("replica 0:")
    prompts = {f"s{i}": [40 + i, 41] for i in range(4)}
    survivors = wait_all(engine, prompts, 3)
    assert all(survivors[rid] == (expected(p, 3), "length") for rid, p in prompts.items())
    assert engine.router.routed == [1, 4]
  finally:
    engine.shutdown()


def test_lora_adapters_load_on_every_replica(tmp_path):
  from lora_testutil import write_peft_adapter  # noqa: PLC0415 -- only this test needs it

  path = write_peft_adapter(str(tmp_path / "a"), {"wq": (64, 64)}, 2, rank=4, seed=0)
  engine = replicated(n=2, max_loras=2)
  engine.load_lora("a", path)
  assert [[a.name for a in r.list_loras()] for r in engine.replicas] == [["a"], ["a"]]
  engine.remove_lora("a")
  assert all(not r.list_loras() for r in engine.replicas)
