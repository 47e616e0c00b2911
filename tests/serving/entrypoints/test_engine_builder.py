"""`check_setup`: input `build_engine` cannot serve fails with `SetupError` before anything
loads (a directory holding only a config.json stands in for the model, so any load would
fail differently): a model that cannot be found or read, a draft model likewise, a layout
needing more devices than are visible, a draft model with prefill / decode workers."""

import json
import re

import jax
import pytest
from frontend_fake import VOCAB, ByteTokenizer
from kv_event_sub import CacheMirror, replay
from server_procs import free_port, wait_until

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.kv_events import wire_hash
from serving.engine.replicas import ReplicatedEngine
from serving.entrypoints.engine_builder import (
  attach_kv_events,
  build_engine,
  check_model,
  check_setup,
  kv_event_publisher,
)
from serving.entrypoints.startup import BindError, SetupError
from serving.types import SamplingParams

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
SMALL = dict(max_num_seqs=2, max_model_len=128, num_pages=32)


@pytest.fixture
def config_only(tmp_path):
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
  return str(tmp_path / "model")


def test_a_servable_setup_passes(config_only):
  check_setup(config_only, EngineConfig.of(**SMALL))


def test_models_that_cannot_load(tmp_path, config_only):
  with pytest.raises(SetupError, match="is not a preset"):
    build_engine(str(tmp_path / "missing"), EngineConfig.of(**SMALL))
  (tmp_path / "empty").mkdir()
  with pytest.raises(SetupError, match="unsupported model directory"):
    check_model(str(tmp_path / "empty"))
  draft = EngineConfig.of(**SMALL, speculative_method="draft",
                       speculative_model=str(tmp_path / "no-draft"))
  with pytest.raises(SetupError, match="no-draft"):
    check_setup(config_only, draft)


def test_too_few_devices(config_only):
  n = len(jax.devices())
  with pytest.raises(SetupError, match=f"needs {n + 1} devices but only {n} are visible"):
    build_engine(config_only, EngineConfig.of(**SMALL, tp=n + 1))
  with pytest.raises(SetupError, match=f"need {2 * (n + 1)} devices"):
    check_setup(config_only, EngineConfig.of(**SMALL, tp=n + 1, dp=2))


def test_draft_model_with_workers(config_only):
  config = EngineConfig.of(**SMALL, prefill_workers=1, decode_workers=1,
                        speculative_method="draft", speculative_model=config_only)
  with pytest.raises(SetupError, match="prefill / decode workers"):
    check_setup(config_only, config)
  assert issubclass(SetupError, ValueError)  # callers catching ValueError still do


def test_auto_quantization_keeps_gguf_blocks(config_only):
  """The default `quantization="auto"`: a GGUF file is served from its blocks (one set of
  weights for every batch), any other checkpoint as loaded; an explicit choice stays."""
  from checkpoints import presets
  from serving.entrypoints.engine_builder import load_method

  try:
    smollm_path = presets.resolve_preset("smollm2-135m-instruct")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  assert EngineConfig().model.quantization == "auto"
  assert load_method(smollm_path, "auto") == "gguf"
  assert load_method(config_only, "auto") is None
  assert load_method(smollm_path, None) is None  # --quantization=none: dequantized
  assert load_method(config_only, "int8") == "int8"


def test_busy_kv_events_endpoint_is_a_bind_error():
  busy = f"tcp://*:{free_port()}"
  config = EngineConfig.of(**SMALL, kv_events_endpoint=busy)
  first = kv_event_publisher(config)
  try:
    with pytest.raises(BindError, match=f"--kv_events_endpoint={re.escape(busy)}: cannot set "
                       "up the KV event sockets: Address already in use"):
      kv_event_publisher(config)
  finally:
    first.close()
  assert kv_event_publisher(EngineConfig.of(**SMALL)) is None


def test_every_replica_publishes_under_its_rank(tmp_path):
  config = EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=4, num_pages=16,
                           max_num_batched_tokens=32, compilation_cache=False,
                           kv_events_endpoint=f"ipc://{tmp_path}/ev",
                           kv_events_replay_endpoint=f"ipc://{tmp_path}/replay")
  members = [LLMEngine(runner=FakeRunner(num_pages=16, page_size=4, max_num_seqs=2,
                                         vocab_size=VOCAB),
                       tokenizer=ByteTokenizer(), config=config) for _ in range(2)]
  engine = ReplicatedEngine(members, config=config.replace(dp=2))
  attach_kv_events(engine, kv_event_publisher(config), config)
  try:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(6):  # different first pages: the router spreads them
      engine.add_request(f"r{i}", [10 + i] * 9, params, lambda out: None)
    engine.run_until_idle()
    view = engine.prefix_cache_hashes()
    mirror = CacheMirror()

    def caught_up() -> bool:
      for seq, payload in replay(f"ipc://{tmp_path}/replay", mirror.last_seq + 1):
        mirror.apply(seq, payload)
      return all(mirror.blocks[r] == {wire_hash(h) for h in view[r]} for r in (0, 1))

    assert wait_until(caught_up, timeout_s=20)
  finally:
    engine.shutdown()
  assert all(view) and not mirror.errors
