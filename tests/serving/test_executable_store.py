"""The executable store (serving/executable_store.py) on a tiny model.

- A first engine compiles its steps and stores them; a second one, built
  the same way in the same process, loads every step from the store (no
  tracing) and generates exactly the same tokens.
- The key changes with anything the program depends on: another static
  option or other argument shapes miss the store.
- A corrupt file is a cache miss: the step recompiles and overwrites it.
"""

import glob
import os

import numpy as np
import pytest

from checkpoints import load_checkpoint
from serving import executable_store
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.executable_store import ExecutableStore, StepProgram
from serving.types import SamplingParams
from tiny_models import save_tiny_model

PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60], [200, 31, 9, 144, 2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_llama"))
  save_tiny_model("llama", path)
  return load_checkpoint(path)


def make_engine(loaded, cache_dir) -> LLMEngine:
  cfg = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=24,
                     max_num_batched_tokens=16, unroll_layers=False,
                     compilation_cache_dir=str(cache_dir))
  return LLMEngine(loaded, cfg)


def generate(engine) -> list[list[int]]:
  outs = {}
  for i, prompt in enumerate(PROMPTS):
    outs[i] = []
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0.0),
                       outs[i].append)
  engine.run_until_idle()
  return [sum((o.token_ids for o in outs[i]), []) for i in range(len(PROMPTS))]


def steps(engine) -> tuple[StepProgram, ...]:
  r = engine.runner
  return r._prefill, r._decode, r._sample


def test_second_engine_loads_every_step_and_matches(tiny, tmp_path):
  first = make_engine(tiny, tmp_path)
  first_tokens = generate(first)
  assert sum(s.compiled for s in steps(first)) > 0
  assert sum(s.loaded for s in steps(first)) == 0
  stored = glob.glob(os.path.join(tmp_path, "executables", "*.jaxexe"))
  assert len(stored) == sum(s.compiled for s in steps(first))

  second = make_engine(tiny, tmp_path)
  assert generate(second) == first_tokens
  assert sum(s.compiled for s in steps(second)) == 0
  assert sum(s.loaded for s in steps(second)) == len(stored)
  # Serving after warm-up added no program to either engine.
  assert [s.num_programs() for s in steps(second)] == [s.num_programs() for s in steps(first)]


def _double(x, y):
  return x * 2 + y


def test_key_depends_on_static_options_and_shapes(tmp_path):
  import jax

  store = ExecutableStore(str(tmp_path))
  x, y = np.ones((4,), np.float32), np.ones((4,), np.float32)
  base = store.key("f", "a", (x, y))
  assert store.key("f", "a", (x, y)) == base
  assert store.key("f", "b", (x, y)) != base
  assert store.key("g", "a", (x, y)) != base
  assert store.key("f", "a", (x, np.ones((8,), np.float32))) != base
  assert store.key("f", "a", (x, np.ones((4,), np.int32))) != base

  prog = StepProgram("f", jax.jit(_double), static="a", num_fixed=1, store=store)
  np.testing.assert_array_equal(prog(x, y), x * 2 + y)
  np.testing.assert_array_equal(prog(x, y * 3), x * 2 + y * 3)  # same shapes: same program
  assert (prog.compiled, prog.num_programs()) == (1, 1)
  prog(np.ones((8,), np.float32), np.ones((8,), np.float32))
  assert (prog.compiled, prog.num_programs()) == (2, 2)


def test_corrupt_file_is_recompiled(tmp_path, caplog):
  import jax

  store = ExecutableStore(str(tmp_path))
  x = np.arange(4, dtype=np.float32)
  StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)(x, x)
  (path,) = glob.glob(os.path.join(tmp_path, "f-*.jaxexe"))
  with open(path, "wb") as f:
    f.write(b"not an executable")
  prog = StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)
  np.testing.assert_array_equal(prog(x, x), x * 3)
  assert (prog.loaded, prog.compiled) == (0, 1)
  assert "could not load stored executable" in caplog.text
  again = StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)
  again(x, x)
  assert (again.loaded, again.compiled) == (1, 0)  # the rewritten file loads


def test_source_fingerprint_is_stable():
  assert executable_store.source_fingerprint() == executable_store.source_fingerprint()
  assert len(executable_store.source_fingerprint()) == 64


def test_no_store_when_cache_is_off_or_sharded(tmp_path):
  assert ExecutableStore.for_runner(False, str(tmp_path), sharded=False) is None
  assert ExecutableStore.for_runner(True, str(tmp_path), sharded=True) is None
  assert ExecutableStore.for_runner(True, str(tmp_path), sharded=False) is not None
