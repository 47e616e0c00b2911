"""EngineConfig option resolution (serving/config.py): presets against given options."""

import pytest

from serving.config import (
  EngineConfig,
  default_max_loras,
  expected_platform,
  merge_engine_options,
  platform_defaults,
)

PRESET = {"max_model_len": 2048, "dtype": "float32", "weight_dtype": "bfloat16"}


def test_given_options_override_the_preset():
  assert merge_engine_options(PRESET, {"max_model_len": 512}) == {**PRESET, "max_model_len": 512}
  assert merge_engine_options(PRESET, {}) == PRESET


def test_explicit_dtype_takes_the_weights_too():
  merged = merge_engine_options(PRESET, {"dtype": "float32"})
  assert "weight_dtype" not in merged
  assert EngineConfig.of(**merged).model.weight_dtype == "auto"  # follows dtype: float32 weights
  both = merge_engine_options(PRESET, {"dtype": "float32", "weight_dtype": "bfloat16"})
  assert both["weight_dtype"] == "bfloat16"
  assert merge_engine_options(PRESET, {"weight_dtype": "float32"})["weight_dtype"] == "float32"


def test_platform_defaults_sit_under_the_preset_and_the_user():
  """On CPU a server decodes several steps a call and compiles a few buckets whatever the
  model; a preset's or the user's value wins; other platforms add nothing."""
  cpu = merge_engine_options({}, {}, "cpu")
  assert cpu["num_decode_steps"] == 4 and cpu == platform_defaults("cpu")
  c = EngineConfig.of(**cpu)
  assert c.scheduler.prefill_token_buckets == (64, 128, 256, 512)  # capped at 512 tokens
  assert c.scheduler.decode_batch_buckets == (1, 4, 8, 16, 32)
  assert merge_engine_options({"num_decode_steps": 2}, {}, "cpu")["num_decode_steps"] == 2
  assert merge_engine_options({}, {"num_decode_steps": 1}, "cpu")["num_decode_steps"] == 1
  assert merge_engine_options({}, {}, "tpu") == {} == merge_engine_options({}, {})


def test_expected_platform_follows_jax_platforms(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert expected_platform() == "gpu"
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert expected_platform() == "cpu"


def test_default_max_loras():
  assert [default_max_loras(n) for n in (0, 1, 3, 9)] == [1, 1, 3, 4]


def test_chosen_buckets_keep_the_cap_last():
  """A preset's bucket lists stay valid under a smaller or larger cap: entries above
  it are dropped, the cap itself is always the largest bucket."""
  preset = {"prefill_buckets": [64, 128, 256, 512], "decode_buckets": [1, 4, 8, 16, 32]}
  c = EngineConfig.of(**preset)
  assert c.scheduler.prefill_token_buckets == (64, 128, 256, 512)
  assert c.scheduler.decode_batch_buckets == (1, 4, 8, 16, 32)
  small = EngineConfig.of(**preset, max_num_batched_tokens=100, max_num_seqs=6)
  assert small.scheduler.prefill_token_buckets == (64, 100)
  assert small.scheduler.decode_batch_buckets == (1, 4, 6)
  large = EngineConfig.of(**preset, max_num_batched_tokens=2048, max_num_seqs=64)
  assert large.scheduler.prefill_token_buckets == (64, 128, 256, 512, 2048)
  assert large.scheduler.decode_batch_buckets == (1, 4, 8, 16, 32, 64)
  # a prefill call's chunk rows are a decode bucket: 256 tokens -> 16 rows
  assert c.scheduler.prefill_chunk_rows(256) == 16 and c.scheduler.prefill_chunk_rows(64) == 4


def test_default_buckets_are_powers_of_two():
  c = EngineConfig.of(max_num_batched_tokens=512, max_num_seqs=32)
  assert c.scheduler.prefill_token_buckets == (16, 32, 64, 128, 256, 512)
  assert c.scheduler.decode_batch_buckets == (1, 2, 4, 8, 16, 32)


def test_bad_buckets_are_refused():
  with pytest.raises(ValueError, match="at least 1"):
    EngineConfig.of(decode_buckets=(0, 4))


def test_kv_events_options_are_checked():
  cache = EngineConfig.of(kv_events_endpoint="tcp://*:5557", kv_events_topic="kv@pod@m").cache
  assert (cache.kv_events_endpoint, cache.kv_events_format) == ("tcp://*:5557", "array")
  with pytest.raises(ValueError, match="kv_events_endpoint='http://x:1' must start with"):
    EngineConfig.of(kv_events_endpoint="http://x:1")
  with pytest.raises(ValueError, match="kv_events_format='json'"):
    EngineConfig.of(kv_events_endpoint="tcp://*:5557", kv_events_format="json")
  with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
    EngineConfig.of(kv_events_replay_endpoint="tcp://*:5558")
