"""Multi-LoRA on the default model through the real server and the official `openai` client.

Four random adapters (ranks 8 and 4, every projection of all 30 layers) are
served with only two device slots. Each adapter's greedy completion is first
taken alone; then the four and the base model are requested interleaved and
concurrently (swapping adapters through the two slots), and every response
must equal that adapter's alone. An adapter loaded and unloaded at run time
serves and then 404s. Nothing compiles after warm-up (a jax.monitoring
listener watches the whole run), and every page and slot is free at the end.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from compile_watch import compile_events
from frontend_fake import InProcessServer, wait_for
from lora_testutil import write_peft_adapter
from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG, require_real_model

from checkpoints.lora import module_dims
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine

pytestmark = pytest.mark.slow  # the default model with adapters

NAME = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  require_real_model()
  root = tmp_path_factory.mktemp("adapters")
  config = EngineConfig.of(**{**DEFAULT_MODEL_TEST_CONFIG, "max_loras": 2, "max_lora_rank": 8})
  engine = build_engine(DEFAULT_MODEL, config)
  cfg = engine.runner.source_cfg
  paths = {}
  for i, (name, rank) in enumerate([("a", 8), ("b", 4), ("c", 8), ("d", 4), ("e", 8)]):
    paths[name] = write_peft_adapter(str(root / name), module_dims(cfg), cfg.num_layers,
                                     rank=rank, seed=i, std=0.06)
  for name in "abcd":
    engine.load_lora(name, paths[name])
  with InProcessServer(engine, served_model_name=NAME, allow_runtime_lora=True) as srv:
    yield srv, paths


def complete(client, model: str, prompt: str) -> str:
  resp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                   extra_body={"ignore_eos": True})
  return resp.choices[0].text


def test_interleaved_adapters_match_each_alone(served):
  srv, paths = served
  client = openai.OpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=300)
  models = [NAME, "a", "b", "c", "d"]
  alone = {(m, p): complete(client, m, p) for m in models for p in PROMPTS}
  # The adapters matter: they change the base model's greedy text.
  for p in PROMPTS:
    assert len({alone[(m, p)] for m in models}) >= 4, [alone[(m, p)] for m in models]
  with compile_events() as events:
    swaps_before = srv.engine.stats().lora_swaps_total
    jobs = [(m, p) for p in PROMPTS for m in ["a", "b", NAME, "c", "d", "a", "c"]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      got = list(pool.map(lambda job: complete(client, *job), jobs))
    for job, text in zip(jobs, got, strict=True):
      assert text == alone[job], job
    assert srv.engine.stats().lora_swaps_total > swaps_before
    # Run-time load, use, unload; the chat endpoint selects adapters the same way.
    httpx_resp = client.post("/load_lora_adapter", cast_to=str,
                             body={"lora_name": "e", "lora_path": paths["e"]})
    assert "e" in httpx_resp
    e_text = complete(client, "e", PROMPTS[0])
    assert e_text not in {alone[(m, PROMPTS[0])] for m in models}
    chat = client.chat.completions.create(model="e", max_tokens=4, temperature=0.0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "e" and chat.choices[0].message.content
    assert {m.id for m in client.models.list().data} == {NAME, DEFAULT_MODEL, *"abcde"}
    client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "e"})
    with pytest.raises(openai.NotFoundError):
      complete(client, "e", PROMPTS[0])
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  engine = srv.engine
  assert wait_for(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
  assert engine.allocator.num_free == engine.allocator.num_usable
  assert engine.lora_slots.refs == [0, 0]
