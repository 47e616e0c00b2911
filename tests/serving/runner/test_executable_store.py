"""The executable store (serving/runner/executable_store.py) on a tiny model.

- A first engine compiles its steps and stores them; a second one, built
  the same way, loads every step from the store (no tracing) and generates
  exactly the same tokens. This runs in a worker process without JAX's
  persistent cache, as the launcher does (the test process has it on, and
  the store never writes where it is on).
- The key changes with anything the program depends on: another static
  option or other argument shapes miss the store.
- A corrupt file is a cache miss: the step recompiles and overwrites it.
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from server_procs import xla_flags

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.entrypoints.engine_builder import build_engine
from serving.runner import executable_store
from serving.runner.executable_store import ExecutableStore, StepProgram
from serving.types import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
REPO = os.path.dirname(TESTS)

PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60], [200, 31, 9, 144, 2]]


@pytest.fixture
def toy_store_writes(monkeypatch):
  """Lets the store write in this process: the toy programs below compile in milliseconds,
  far under the JAX cache's 0.5 s threshold, so none of them comes from JAX's cache."""
  monkeypatch.setattr(executable_store, "jax_cache_active", lambda: False)


def make_engine(path, cache_dir) -> LLMEngine:
  cfg = EngineConfig.of(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=24,
                     max_num_batched_tokens=16, unroll_layers=False,
                     compilation_cache_dir=str(cache_dir))
  return build_engine(path, cfg)


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


def _worker(model_dir: str, cache_dir: str, engines: str = "2") -> None:
  """`engines` engines in a row on one store; prints one JSON line."""
  out = {}
  for name in ("first", "second")[:int(engines)]:
    engine = make_engine(model_dir, cache_dir)
    tokens = generate(engine)  # a warm start serves while its other programs load
    out[name] = {"tokens": tokens,
                 "background": sum(s.wait_loaded() for s in steps(engine)),
                 "compiled": sum(s.compiled for s in steps(engine)),
                 "loaded": sum(s.loaded for s in steps(engine)),
                 "programs": [s.num_programs() for s in steps(engine)]}
  out["stored"] = len(glob.glob(os.path.join(cache_dir, "executables", "*.jaxexe")))
  print(json.dumps(out), flush=True)


def _run_worker(model_dir: str, cache_dir: str, engines: int, devices: int) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": xla_flags(devices),
         "PYTHONPATH": os.pathsep.join([REPO, TESTS])}
  proc = subprocess.run([sys.executable, __file__, model_dir, cache_dir, str(engines)], env=env,
                        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_device_store(tmp_path_factory):
  """A tiny Llama and a store two one-device engines used in a row (a worker process):
  (model dir, cache dir, the worker's report)."""
  from tiny_models import save_tiny_model

  tmp = tmp_path_factory.mktemp("store")
  model_dir, cache = str(tmp / "model"), str(tmp / "cache")
  save_tiny_model("llama", model_dir)
  return model_dir, cache, _run_worker(model_dir, cache, 2, devices=1)


def test_second_engine_loads_every_step_and_matches(one_device_store):
  res = one_device_store[2]
  first, second = res["first"], res["second"]
  assert first["compiled"] > 0 and first["loaded"] == 0
  assert res["stored"] == first["compiled"]
  assert second["tokens"] == first["tokens"]
  assert second["compiled"] == 0 and second["loaded"] == res["stored"]
  # Warm: the first bucket of each step (prefill, decode, sample) loaded before serving,
  # the others meanwhile.
  assert first["background"] == 0 and second["background"] == res["stored"] - 3
  # Serving after warm-up added no program to either engine.
  assert second["programs"] == first["programs"]


@pytest.mark.slow
def test_processes_with_other_device_counts_share_a_store(one_device_store):
  """A process that sees 8 devices (serving on one) next to a one-device process with the
  same options: each gets executables for its own device set, and a warm restart of the
  8-device process loads its own and serves the same tokens (it once crashed there:
  "Expected args to execute_sharded_on_local_devices to have 8 shards"). The one-device
  process is the module's first worker (its store holds what its first engine compiled)."""
  model_dir, cache, res = one_device_store
  one = res["first"]
  eight = _run_worker(model_dir, cache, 1, devices=8)["first"]
  warm = _run_worker(model_dir, cache, 1, devices=8)["first"]
  assert one["compiled"] > 0 and eight["compiled"] > 0 and eight["loaded"] == 0
  assert warm["compiled"] == 0 and warm["loaded"] == eight["compiled"]
  assert one["tokens"] == eight["tokens"] == warm["tokens"]


def _double(x, y):
  return x * 2 + y


def _stored_sharded_program(path: str) -> None:
  """Writes, at `path`, an executable of `_double` compiled for two devices."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(np.ones((4,), np.float32), NamedSharding(mesh, PartitionSpec("x")))
  compiled = jax.jit(_double).lower(x, x).compile()
  store = ExecutableStore(os.path.dirname(path))
  store.save("f", "tmp", compiled)
  os.replace(store._path("f", "tmp"), path)


def _mismatch_worker(directory: str) -> None:
  """In a two-device process: a single-device program's key holding a two-device program."""
  import logging

  import jax

  logging.basicConfig(level=logging.WARNING)
  store = ExecutableStore(directory)
  x = np.ones((4,), np.float32)
  _stored_sharded_program(store._path("f", store.key("f", "", (x, x))))
  prog = StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)
  out = np.asarray(prog(x, x)).tolist()
  print(json.dumps({"out": out, "loaded": prog.loaded, "compiled": prog.compiled}), flush=True)


def test_a_stored_program_for_other_devices_is_recompiled(tmp_path):
  """A file under the right key that holds a program for another device set (what a
  mixed-up store would give) is a miss: recompiled, never called."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": xla_flags(2),
         "PYTHONPATH": os.pathsep.join([REPO, TESTS])}
  proc = subprocess.run([sys.executable, __file__, "--mismatch", str(tmp_path)], env=env,
                        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res == {"out": [3.0] * 4, "loaded": 0, "compiled": 1}
  assert "could not load stored executable" in proc.stderr and "not on one" in proc.stderr


def test_key_depends_on_static_options_and_shapes(tmp_path, toy_store_writes, monkeypatch):
  import jax

  store = ExecutableStore(str(tmp_path))
  x, y = np.ones((4,), np.float32), np.ones((4,), np.float32)
  base = store.key("f", "a", (x, y))
  assert store.key("f", "a", (x, y)) == base
  assert store.key("f", "b", (x, y)) != base
  assert store.key("g", "a", (x, y)) != base
  assert store.key("f", "a", (x, np.ones((8,), np.float32))) != base
  assert store.key("f", "a", (x, np.ones((4,), np.int32))) != base
  # Nor are programs compiled under other XLA flags (server_procs.FAST_COMPILE_XLA_FLAGS).
  given = os.environ.get("XLA_FLAGS", "")
  monkeypatch.setenv("XLA_FLAGS", f"{given} --xla_llvm_disable_expensive_passes=true")
  assert store.key("f", "a", (x, y)) != base
  monkeypatch.setenv("XLA_FLAGS", given)
  assert store.key("f", "a", (x, y)) == base
  # Programs traced with the native kernels (kernels_cpu) are not those traced without.
  import kernels_cpu
  if kernels_cpu.available():
    kernels_cpu.library.isa.cache_clear()
    try:
      monkeypatch.setenv("XLASERVE_NATIVE", "0")
      assert store.key("f", "a", (x, y)) != base
    finally:
      monkeypatch.delenv("XLASERVE_NATIVE")
      kernels_cpu.library.isa.cache_clear()
  # Nor are programs traced with the other instruction set's targets.
  if kernels_cpu.library.isa() == "avx512" and "avx2" in kernels_cpu.library.usable_isas():
    try:
      monkeypatch.setenv("XLASERVE_NATIVE_ISA", "avx2")
      kernels_cpu.library.isa.cache_clear()
      assert store.key("f", "a", (x, y)) != base
    finally:
      monkeypatch.delenv("XLASERVE_NATIVE_ISA")
      kernels_cpu.library.isa.cache_clear()

  prog = StepProgram("f", jax.jit(_double), static="a", num_fixed=1, store=store)
  np.testing.assert_array_equal(prog(x, y), x * 2 + y)
  np.testing.assert_array_equal(prog(x, y * 3), x * 2 + y * 3)  # same shapes: same program
  assert (prog.compiled, prog.num_programs()) == (1, 1)
  prog(np.ones((8,), np.float32), np.ones((8,), np.float32))
  assert (prog.compiled, prog.num_programs()) == (2, 2)


def test_corrupt_file_is_recompiled(tmp_path, caplog, toy_store_writes):
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


def test_nothing_written_while_jax_cache_is_on(tmp_path, monkeypatch):
  import jax

  monkeypatch.setattr(executable_store, "jax_cache_active", lambda: True)
  store = ExecutableStore(str(tmp_path))
  prog = StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)
  x = np.ones((4,), np.float32)
  np.testing.assert_array_equal(prog(x, x), x * 3)
  assert prog.compiled == 1 and not os.listdir(tmp_path)




def test_files_others_can_write_are_not_loaded(tmp_path, caplog, toy_store_writes):
  import jax

  store = ExecutableStore(str(tmp_path / "exe"))
  x = np.ones((4,), np.float32)
  StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)(x, x)
  (path,) = glob.glob(os.path.join(store.directory, "f-*.jaxexe"))
  os.chmod(path, 0o666)
  prog = StepProgram("f", jax.jit(_double), static="", num_fixed=0, store=store)
  np.testing.assert_array_equal(prog(x, x), x * 3)
  assert (prog.loaded, prog.compiled) == (0, 1)
  assert "not owned by this user or writable by others" in caplog.text


if __name__ == "__main__":
  if sys.argv[1] == "--mismatch":
    _mismatch_worker(sys.argv[2])
  else:
    _worker(*sys.argv[1:])
