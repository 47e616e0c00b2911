"""`EngineClient` conformance (serving/engine/client.py): the same scenarios, run
against each of its three implementations, built from real `LLMEngine`s over
`FakeRunner`s (no jax, no mocks of an engine):

- "single": one `LLMEngine`;
- "replicated": a `ReplicatedEngine` of two replicas (serving/engine/replicas.py);
- "disaggregated": a `DisaggregatedEngine`, one prefill and one decode worker
  (serving/engine/disaggregated.py), whose prompts of a page or more move their
  KV pages between the two FakeRunners (checked on every read).

Each member runner sits in a `FaultyRunner` (tests/runner_faults.py): a prompt
whose first token is FAIL fails its step with a `StepError` naming it; one
whose first token is DIE loses the device. Checked per implementation: it is an
`EngineClient`; greedy generation (FakeRunner's tokens: output i is prompt token
i mod length) and the same tokens from all three; abort frees the request and
its pages; the stats counters move and the per-member rows add up; health is
None while it serves and names a lost device; a failed step fails only its
request; LoRA load / list / get / remove and their errors; structured-output
checks and constrained generation; start() / shutdown() with the background
flag; invalid requests refused with ValueError, the engine serving the next.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from frontend_fake import VOCAB, ByteTokenizer, fake_lora_loader, wait_for
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine import EngineClient, LLMEngine, llm_engine
from serving.engine.disaggregated import DisaggregatedEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.replicas import ReplicatedEngine
from serving.types import RequestOutput, SamplingParams

PAGE, SLOTS, MAX_LEN = 4, 4, 64
KINDS = ("single", "replicated", "disaggregated")
FAIL, DIE = 0, 1  # first prompt token: the step fails / the device is lost
LONG = list(b"the quick brown fox jumps")  # 25 tokens: several pages (moved when disaggregated)
SHORT = list(b"abc")  # under a page: prefilled where it is decoded
PROMPTS = {"long": LONG, "short": SHORT, "mid": list(b"hello, world")}


def base_config(**overrides) -> EngineConfig:
  return EngineConfig.of(max_num_seqs=SLOTS, max_model_len=MAX_LEN, page_size=PAGE, num_pages=48,
                      max_num_batched_tokens=32, kv_transfer_pages=2, compilation_cache=False,
                      **overrides)


def member(config: EngineConfig, tokenizer, vocab: int) -> LLMEngine:
  """One real engine over a FakeRunner inside a FaultyRunner (module doc)."""
  runner = FakeRunner(num_pages=config.cache.num_pages, page_size=config.cache.page_size,
                      max_num_seqs=config.scheduler.max_num_seqs, vocab_size=vocab)
  faulty = FaultyRunner(runner, fail_request=lambda s: s.prompt_ids[0] == FAIL,
                        dead_request=lambda s: s.prompt_ids[0] == DIE)
  return LLMEngine(runner=faulty, tokenizer=tokenizer, config=config, model_name="fake",
                   lora_loader=fake_lora_loader if config.lora.max_loras else None)


def build(kind: str, tokenizer=None, vocab: int = VOCAB, **overrides) -> EngineClient:
  """The `kind` implementation, its members built alike (`overrides`: EngineConfig)."""
  tokenizer = tokenizer or ByteTokenizer()
  config = base_config(**overrides)
  if kind == "single":
    return member(config, tokenizer, vocab)
  if kind == "replicated":
    return ReplicatedEngine([member(config, tokenizer, vocab) for _ in range(2)],
                            config=config.replace(dp=2))
  return DisaggregatedEngine([member(config, tokenizer, vocab)],
                             [member(config, tokenizer, vocab)],
                             config=config.replace(prefill_workers=1,
                                                        decode_workers=1))


@pytest.fixture(params=KINDS)
def kind(request) -> str:
  return request.param


@pytest.fixture
def engine(kind):
  eng = build(kind)
  yield eng
  eng.shutdown(timeout_s=2.0)


def greedy(n: int, **kw) -> SamplingParams:
  return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def expected(prompt: list[int], n: int, shift: int = 0) -> list[int]:
  """FakeRunner's tokens: output i is prompt token i mod len (+ the adapter's id)."""
  return [(prompt[i % len(prompt)] + shift) % VOCAB for i in range(n)]


def submit(engine: EngineClient, prompts: dict[str, list[int] | str],
           params: SamplingParams, lora: str | None = None) -> dict[str, list[RequestOutput]]:
  outs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
  for rid, prompt in prompts.items():
    engine.add_request(rid, prompt, params, outs[rid].append, lora=lora)
  return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
  return [t for o in outs for t in o.token_ids]


def finished(outs: list[RequestOutput]) -> bool:
  return bool(outs) and outs[-1].finished


def assert_idle_and_free(engine: EngineClient) -> None:
  """Nothing unfinished, nothing running or waiting, every KV page obtainable."""
  assert not engine.has_unfinished()
  for row in engine.replica_stats():
    assert (row.num_running, row.num_waiting) == (0, 0)
    assert row.num_pages_free == row.num_pages_total > 0


# ---- the protocol ----

def test_is_an_engine_client(engine):
  assert isinstance(engine, EngineClient)
  assert not isinstance(object(), EngineClient)


def test_model_information(engine, kind):
  assert engine.model_name == "fake"
  assert engine.tokenizer.vocab_size == VOCAB
  assert engine.max_model_len == MAX_LEN == engine.config.scheduler.max_model_len
  assert engine.num_slots == {"single": SLOTS, "replicated": 2 * SLOTS,
                              "disaggregated": SLOTS}[kind]
  assert engine.num_programs >= 0
  assert len(engine.replica_stats()) == len(engine.replica_roles)
  assert engine.replica_roles == {"single": ["both"], "replicated": ["both", "both"],
                                  "disaggregated": ["prefill", "decode"]}[kind]


# ---- generation ----

def test_generates_greedy_tokens_to_completion(engine):
  outs = submit(engine, PROMPTS, greedy(7))
  engine.run_until_idle()
  for rid, prompt in PROMPTS.items():
    assert tokens(outs[rid]) == expected(prompt, 7), rid
    assert outs[rid][-1].finish_reason == "length"
    assert sum(o.finished for o in outs[rid]) == 1
    assert "".join(o.text for o in outs[rid]) == bytes(expected(prompt, 7)).decode()
  assert_idle_and_free(engine)
  assert engine.health() is None


def test_the_three_engines_give_the_same_tokens():
  prompts = {f"r{i}": list(b"prefix shared by all ") + [65 + i] * (i + 1) for i in range(6)}
  prompts.update(PROMPTS)
  results = {}
  for kind in KINDS:
    eng = build(kind)
    outs = submit(eng, prompts, greedy(9))
    eng.run_until_idle()
    results[kind] = {rid: tokens(o) for rid, o in outs.items()}
    eng.shutdown()
  assert results["single"] == results["replicated"] == results["disaggregated"]
  assert results["single"]["long"] == expected(LONG, 9)


def test_step_loop_by_hand(engine):
  outs = submit(engine, {"a": LONG}, greedy(5))
  assert engine.has_unfinished()
  for _ in range(200):
    if not engine.has_unfinished():
      break
    engine.step()
  assert tokens(outs["a"]) == expected(LONG, 5)
  assert_idle_and_free(engine)


# ---- abort ----

@pytest.mark.parametrize("steps_first", [0, 1, 4])
def test_abort_frees_the_request(engine, steps_first):
  outs = submit(engine, {"victim": LONG, "other": SHORT}, greedy(30))
  for _ in range(steps_first):
    engine.step()
  engine.abort("victim")
  engine.abort("no-such-request")  # ignored
  engine.run_until_idle()
  assert outs["victim"][-1].finish_reason == "abort"
  assert sum(o.finished for o in outs["victim"]) == 1
  assert tokens(outs["other"]) == expected(SHORT, 30)
  assert_idle_and_free(engine)
  again = submit(engine, {"victim": LONG}, greedy(3))  # its id is free again
  engine.run_until_idle()
  assert tokens(again["victim"]) == expected(LONG, 3)


# ---- stats ----

def test_stats_counters_move(engine, kind):
  before = engine.stats()
  assert (before.prompt_tokens_total, before.generation_tokens_total) == (0, 0)
  submit(engine, PROMPTS, greedy(6))
  engine.run_until_idle()
  after = engine.stats()
  assert after.prompt_tokens_total == sum(len(p) for p in PROMPTS.values())
  assert after.generation_tokens_total == 6 * len(PROMPTS)
  assert after.prefill_tokens_computed_total > 0
  rows = engine.replica_stats()
  decoded = [r for r, role in zip(rows, engine.replica_roles, strict=True) if role != "prefill"]
  assert sum(r.generation_tokens_total for r in decoded) == after.generation_tokens_total
  transfers = engine.transfer_stats()
  if kind == "disaggregated":  # only LONG and "mid" span more than one page
    assert transfers["kv_transfers_total"] == 2 and transfers["kv_transfer_failures_total"] == 0
    assert transfers["kv_transfer_pages_total"] > 0
  else:
    assert transfers == {}


# ---- failures and health ----

def test_a_failed_step_fails_only_its_request(engine):
  outs = submit(engine, {"bad": [FAIL, *LONG[1:]], "good": LONG}, greedy(6))
  engine.run_until_idle()
  assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].error
  assert outs["good"][-1].finish_reason == "length"
  assert tokens(outs["good"]) == expected(LONG, 6)
  assert engine.health() is None
  nxt = submit(engine, {"next": SHORT}, greedy(4))
  engine.run_until_idle()
  assert tokens(nxt["next"]) == expected(SHORT, 4)
  assert_idle_and_free(engine)


def test_an_idle_loop_hands_the_heap_back_after_start_up_and_after_a_burst(monkeypatch):
  """`release_free_heap` runs after warm-up, once the background loop has been idle
  IDLE_TRIM_S after start-up, and again after a burst of requests, not while idle on."""
  calls = []
  monkeypatch.setattr(llm_engine, "release_free_heap", lambda: calls.append(time.monotonic()))
  monkeypatch.setattr(llm_engine, "IDLE_TRIM_S", 0.05)
  engine = build("single")
  assert len(calls) == 1  # after warm-up
  engine.start()
  try:
    assert wait_for(lambda: len(calls) == 2)  # start-up's idle trim
    time.sleep(0.3)
    assert len(calls) == 2  # nothing new to hand back while idle
    outs = submit(engine, {"a": SHORT, "b": LONG}, greedy(4))
    assert wait_for(lambda: finished(outs["a"]) and finished(outs["b"]))
    assert wait_for(lambda: len(calls) == 3)
  finally:
    engine.shutdown()


def test_health_names_a_lost_device(engine):
  engine.start()
  assert engine.health() is None
  outs = submit(engine, {"doomed": [DIE, 97, 98]}, greedy(4))  # under a page: decoded there
  assert wait_for(lambda: finished(outs["doomed"]))
  assert outs["doomed"][-1].finish_reason == "error"
  assert wait_for(lambda: engine.health() is not None)
  assert "lost" in engine.health()


# ---- invalid requests ----

INVALID = {  # prompt, SamplingParams fields, LoRA adapter
    "token id out of range": ([VOCAB], {}, None),
    "negative token id": ([-1, 97], {}, None),
    "empty prompt": ("", {}, None),
    "prompt too long": ([97] * MAX_LEN, {}, None),
    "prompt + max_tokens too long": ([97] * 40, {"max_tokens": 30}, None),
    "stop token id out of range": (SHORT, {"stop_token_ids": [VOCAB]}, None),
    "unknown LoRA adapter": (SHORT, {}, "nope"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_request_is_refused_and_the_engine_serves_on(engine, case):
  prompt, fields, lora = INVALID[case]
  params = SamplingParams(**{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **fields})
  got: list[RequestOutput] = []
  with pytest.raises(ValueError):
    engine.add_request("bad", prompt, params, got.append, lora=lora)
  assert got == [] and not engine.has_unfinished()
  outs = submit(engine, {"bad": LONG}, greedy(5))  # the id was not taken
  engine.run_until_idle()
  assert tokens(outs["bad"]) == expected(LONG, 5)
  assert engine.health() is None
  assert_idle_and_free(engine)


def test_a_duplicate_request_id_is_refused(engine):
  outs = submit(engine, {"dup": LONG}, greedy(5))
  with pytest.raises(ValueError, match="duplicate"):
    engine.add_request("dup", SHORT, greedy(5), outs["dup"].append)
  engine.run_until_idle()
  assert tokens(outs["dup"]) == expected(LONG, 5)


# ---- background thread ----

def test_start_and_shutdown_run_the_loop_in_the_background(kind):
  engine = build(kind)
  assert not engine.runs_in_background
  engine.start()
  engine.start()  # idempotent
  assert engine.runs_in_background
  done = {rid: threading.Event() for rid in PROMPTS}
  outs: dict[str, list[RequestOutput]] = {rid: [] for rid in PROMPTS}

  def collector(rid):
    def on_output(out: RequestOutput) -> None:
      outs[rid].append(out)
      if out.finished:
        done[rid].set()
    return on_output

  for rid, prompt in PROMPTS.items():
    engine.add_request(rid, prompt, greedy(6), collector(rid))
  assert all(event.wait(10) for event in done.values())
  assert all(tokens(outs[rid]) == expected(p, 6) for rid, p in PROMPTS.items())
  assert engine.health() is None
  assert wait_for(lambda: not engine.has_unfinished())
  engine.shutdown(timeout_s=5.0)
  assert not engine.runs_in_background


# ---- LoRA adapters ----

def adapter_dir(tmp_path, name: str, **overrides) -> str:
  path = tmp_path / name
  path.mkdir()
  config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
            **overrides}
  (path / "adapter_config.json").write_text(json.dumps(config))
  return str(path)


def test_lora_without_lora_slots_is_refused_alike(engine):
  assert engine.list_loras() == []
  with pytest.raises(ValueError, match="LoRA is not enabled"):
    engine.load_lora("sql", "/nowhere")
  with pytest.raises(ValueError, match="no LoRA adapter"):
    engine.get_lora("sql")
  with pytest.raises(KeyError):
    engine.remove_lora("sql")


def test_lora_load_list_get_serve_remove(kind, tmp_path):
  engine = build(kind, max_loras=2)
  path = adapter_dir(tmp_path, "sql")
  adapter = engine.load_lora("sql", path)
  assert (adapter.name, adapter.path) == ("sql", path)
  assert [a.name for a in engine.list_loras()] == ["sql"]
  assert engine.get_lora("sql").lora_id == adapter.lora_id
  with pytest.raises(ValueError, match="already loaded"):
    engine.load_lora("sql", path)
  with pytest.raises(ValueError):  # not an adapter directory
    engine.load_lora("broken", str(tmp_path / "missing"))
  with pytest.raises(ValueError):  # the base model's name
    engine.load_lora("fake", path)
  assert [a.name for a in engine.list_loras()] == ["sql"]
  outs = submit(engine, {"tuned": LONG}, greedy(5), lora="sql")
  engine.run_until_idle()
  assert tokens(outs["tuned"]) == expected(LONG, 5, shift=adapter.lora_id)
  engine.remove_lora("sql")
  assert engine.list_loras() == []
  with pytest.raises(ValueError):
    engine.add_request("late", LONG, greedy(5), lambda out: None, lora="sql")
  with pytest.raises(KeyError):
    engine.remove_lora("sql")
  assert_idle_and_free(engine)
  engine.shutdown()


# ---- structured outputs (the default model's tokenizer: llguidance needs a real one) ----

CHOICE = SamplingParams(max_tokens=8, temperature=0.0,
                        structured_outputs={"choice": ["yes", "no"]})


def test_structured_outputs_are_checked_and_enforced(kind, default_tokenizer):
  engine = build(kind, tokenizer=default_tokenizer, vocab=49152)
  engine.check_structured_outputs(greedy(4))  # nothing to check
  engine.check_structured_outputs(CHOICE)
  bad = SamplingParams(max_tokens=8, structured_outputs={"regex": "(unclosed"})
  with pytest.raises(ValueError, match="structured_outputs.regex"):
    engine.check_structured_outputs(bad)
  prompt = default_tokenizer.encode("Is the sky blue? Answer yes or no, please:",
                                    add_special_tokens=False)
  assert len(prompt) > PAGE
  with pytest.raises(ValueError, match="structured_outputs.regex"):
    engine.add_request("bad", prompt, bad, lambda out: None)
  outs = submit(engine, {"c": prompt}, CHOICE)
  engine.run_until_idle()
  assert "".join(o.text for o in outs["c"]) in ("yes", "no")
  assert outs["c"][-1].finish_reason == "stop"
  assert_idle_and_free(engine)
  engine.shutdown()


def test_structured_outputs_refused_without_a_grammar_tokenizer(engine):
  with pytest.raises(ValueError, match="tokenizer"):
    engine.check_structured_outputs(CHOICE)
  outs = submit(engine, {"plain": SHORT}, greedy(3))
  engine.run_until_idle()
  assert tokens(outs["plain"]) == expected(SHORT, 3)
