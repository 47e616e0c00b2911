"""EngineConfig option resolution (serving/config.py): presets against given options."""

from serving.config import EngineConfig, default_max_loras, merge_engine_options

PRESET = {"max_model_len": 2048, "dtype": "float32", "weight_dtype": "bfloat16"}


def test_given_options_override_the_preset():
  assert merge_engine_options(PRESET, {"max_model_len": 512}) == {**PRESET, "max_model_len": 512}
  assert merge_engine_options(PRESET, {}) == PRESET


def test_explicit_dtype_takes_the_weights_too():
  merged = merge_engine_options(PRESET, {"dtype": "float32"})
  assert "weight_dtype" not in merged
  assert EngineConfig(**merged).weight_dtype == "auto"  # follows dtype: float32 weights
  both = merge_engine_options(PRESET, {"dtype": "float32", "weight_dtype": "bfloat16"})
  assert both["weight_dtype"] == "bfloat16"
  assert merge_engine_options(PRESET, {"weight_dtype": "float32"})["weight_dtype"] == "float32"


def test_default_max_loras():
  assert [default_max_loras(n) for n in (0, 1, 3, 9)] == [1, 1, 3, 4]
