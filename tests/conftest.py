"""Session-wide test set-up: JAX on CPU with the persistent compilation cache, torch
(the tiny models' reference) and OpenBLAS on one thread, and the longest modules first
under xdist."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# numpy's and scipy's OpenBLAS (jax's CPU Cholesky and triangular solves call scipy's LAPACK)
# start one thread per core, and their idle threads spin: on the suite's two cores, beside
# the other worker and the XLA programs of the same test, GPTQ's 150 small factorisations
# (576 and 1536 inputs) took 80 CPU-seconds with the default threads and 5.5 with one
# (docs/testing.md). Read when OpenBLAS loads, so set before numpy is imported; servers
# started by the tests inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

_CACHE = os.environ.get("XLASERVE_TEST_CACHE",
                        os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import torch  # noqa: E402

# The references are tiny models run one token at a time (tiny_models.torch_greedy): torch's
# intra-op threads only spin against each other and the JAX programs there. One thread took a
# tiny Gemma 3's 4 x 64-token reference from 40 CPU-seconds to 2 (docs/testing.md).
torch.set_num_threads(1)

import pytest  # noqa: E402
from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG  # noqa: E402


@pytest.fixture(scope="session")
def default_tokenizer():
  """The default model's tokenizer, read from its GGUF (skips when it is not installed)."""
  from checkpoints import presets
  from checkpoints.gguf_reader import GGUFFile
  from checkpoints.tokenizer import Tokenizer

  try:
    path = presets.resolve_preset(DEFAULT_MODEL)
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return Tokenizer.from_gguf_metadata(GGUFFile(path))


@pytest.fixture(scope="session")
def default_llm():
  """The default model (SmolLM2-135M-Instruct GGUF), loaded once per session."""
  from serving import LLM
  return LLM(DEFAULT_MODEL, **DEFAULT_MODEL_TEST_CONFIG)


@pytest.fixture
def force_avx2(monkeypatch):
  """The native kernels' AVX2 path for this test (`XLASERVE_NATIVE_ISA=avx2`; programs
  traced inside it call the AVX2 targets). Skips where this CPU or library has no AVX2
  set. JAX's trace caches are cleared on the way in and out: a function traced with the
  other set would otherwise keep its targets."""
  from kernels_cpu import library

  if "avx2" not in library.usable_isas():
    pytest.skip("native kernels not built or CPU lacks AVX2 + FMA + F16C")
  monkeypatch.setenv("XLASERVE_NATIVE_ISA", "avx2")
  library.isa.cache_clear()
  jax.clear_caches()
  assert library.isa() == "avx2"
  yield
  monkeypatch.delenv("XLASERVE_NATIVE_ISA")
  library.isa.cache_clear()
  jax.clear_caches()


# The modules that take longest in the full suite, longest first (`--durations`, summed per
# module, 2026-12-06; the batch-invariance, executable-store and kernel-backend modules then
# moved down by their measured CPU saving; the first five re-measured alone late that day, CPU
# seconds with fresh caches: batch invariance 157, quant quality 157 after OpenBLAS went to one
# thread, pipeline 120 and default model 91 each with a `default_llm` of their own, batch
# job 65). `--dist loadfile` hands each worker whole modules
# in collection order; pytest-xdist's default `--loadscope-reorder` sorts them by test count,
# which put these one-to-six-test modules last: the run ended with one worker alone on the
# batch-invariance module for ~14 minutes while the other idled. Longest first (the classic
# greedy schedule) lets the short modules fill in around them. docs/testing.md.
LONGEST_MODULES = (
    "tests/serving/engine/test_batch_invariance.py",
    "tests/serving/runner/test_quant_quality.py",
    "tests/sharding/test_pipeline.py",
    "tests/serving/entrypoints/test_default_model.py",
    "tests/serving/entrypoints/test_batch_e2e.py",
    "tests/serving/runner/test_quant_engine.py",
    "tests/ops/test_ops_security.py",
    "tests/sharding/test_quant_sharded.py",
    "tests/serving/runner/test_executable_store.py",
    "tests/sharding/test_multihost.py",
    "tests/serving/entrypoints/test_structured_e2e.py",
    "tests/ops/test_ops_load.py",
    "tests/ops/test_ops_notebook.py",
    "tests/serving/runner/test_native_decode.py",
    "tests/serving/runner/test_kernel_backend.py",
    "tests/serving/entrypoints/test_dp_e2e.py",
    "tests/ops/test_ops_isolation.py",
    "tests/serving/entrypoints/test_pd_e2e.py",
    "tests/serving/models/test_gemma_features.py",
    "tests/serving/entrypoints/test_console_script.py",
    "tests/serving/engine/test_engine.py",
    "tests/sharding/test_lora_tp.py",
    "tests/sharding/test_gpt_oss_parallel.py",
    "tests/sharding/test_gemma_parallel.py",
)


def pytest_configure(config):
  """Under pytest-xdist, modules are handed out in collection order
  (`pytest_collection_modifyitems` below), not re-sorted by test count."""
  if config.pluginmanager.hasplugin("xdist"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """LONGEST_MODULES first, in that order; the others after them as collected (a stable
  sort: the tests of a module keep their order). Names not collected, as under Bazel (one
  test file per target), change nothing."""
  rank = {m: i for i, m in enumerate(LONGEST_MODULES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
