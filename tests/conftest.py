"""Session-wide test set-up: JAX on CPU with the persistent compilation cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_CACHE = os.environ.get("XLASERVE_TEST_CACHE",
                        os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402

# Engine options for tests on the default model: small, quick to compile.
DEFAULT_MODEL_TEST_CONFIG = dict(max_num_seqs=8, max_model_len=256, num_pages=96,
                                 max_num_batched_tokens=64, unroll_layers=False,
                                 dtype="float32")


@pytest.fixture(scope="session")
def default_llm():
  """The default model (SmolLM2-135M-Instruct GGUF), loaded once per session."""
  from serving import LLM
  return LLM("smollm2-135m-instruct", **DEFAULT_MODEL_TEST_CONFIG)
