"""Helpers for the sharding tests.

The main pytest process has initialised jax with one CPU device, so every
multi-device check runs in a subprocess (`run_worker`) that starts with
`--xla_force_host_platform_device_count=8`; the worker prints one JSON line
the test asserts on. Inside a worker, `Driver` runs greedy generation
through a runner's own prefill/decode programs (compiled once with
`lower().compile()`, so the HLO text comes for free) and `hlo_collectives`
reads the collectives out of that text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
from server_procs import xla_flags

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTS = os.path.join(REPO, "tests")
# Small engine: 2 slots, 16-token prefill bucket, decode buckets (1, 2), scanned layers.
ENGINE_KW = dict(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=32,
                 max_num_batched_tokens=16, unroll_layers=False, compilation_cache=False)
PAGES_PER_SEQ = 4
PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60], [200, 31, 9, 144, 2]]  # ragged: 10 and 5
VOCAB = 300  # tests/tiny_models.py
LOGIT_ATOL = 1e-4  # f32 sharded vs unsharded (observed ~2e-7)


def layout_name(layout: dict) -> str:
  """A parallel layout's short name, e.g. {"tp": 2, "ep": 2} -> "ep2xtp2" (test ids)."""
  return "x".join(f"{k}{v}" for k, v in sorted(layout.items()))


def run_worker(test_file: str, *args: str, devices: int = 8, timeout: float = 240,
               env: dict[str, str] | None = None, fast_compile: bool = True) -> dict:
  """Runs `python test_file *args` on `devices` CPU devices; returns its last JSON line.

  The workers compile tiny models, so they skip LLVM's optimisation passes
  (`server_procs.FAST_COMPILE_XLA_FLAGS`); one that runs the default model's float32
  programs passes `fast_compile=False`."""
  full_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{REPO}:{TESTS}",
              "XLA_FLAGS": xla_flags(devices, fast_compile=fast_compile), **(env or {})}
  proc = subprocess.run([sys.executable, test_file, *args], env=full_env, cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, check=False)
  if proc.returncode:
    raise AssertionError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_setup() -> None:
  """Worker start: the tests' persistent compilation cache (as tests/conftest.py sets it)."""
  import jax

  cache = os.environ.get("XLASERVE_TEST_CACHE", os.path.join(REPO, ".jax_cache"))
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def engine_config(**kw):
  from serving.config import EngineConfig

  return EngineConfig.of(**{**ENGINE_KW, **kw})


def make_runner(loaded, **kw):
  from serving.runner.model_runner import ModelRunner

  return ModelRunner.from_params(loaded.params, loaded.config, engine_config(**kw),
                                num_pages=ENGINE_KW["num_pages"])


def hf_sliced_equal(path: str, loaded, parallel) -> bool:
  """`checkpoints.hf_sharded.load_hf_sharded` on a mesh gives the loader's params exactly."""
  import jax

  from checkpoints.hf_sharded import load_hf_sharded
  from sharding import make_mesh

  got = load_hf_sharded(path, make_mesh(parallel))
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), b)), got.params,
                      loaded.params)
  return all(jax.tree.leaves(same)) and got.config == loaded.config


class Driver:
  """Greedy decoding of a few prompts through one runner (sequence i: slot i). A hybrid
  model's sliding-window group gets the same page ids as the full group (none released:
  the window masks the rows behind it)."""

  def __init__(self, runner):
    self.runner = runner
    self.hlo: dict[str, str] = {}
    self._compiled: dict[tuple, object] = {}

  def _step(self, name: str, inp) -> np.ndarray:
    import jax

    r = self.runner
    key = (name, *(x.shape for x in jax.tree.leaves(inp)))
    if key not in self._compiled:
      fn = getattr(r, f"_{name}").jitted  # the StepProgram's jitted step
      self._compiled[key] = fn.lower(r.params, r.lora, r.state, inp).compile()
      self.hlo[name] = self._compiled[key].as_text()
    r.state, logits = self._compiled[key](r.params, r.lora, r.state, inp)
    return np.asarray(logits)

  def _set_last_tokens(self, slots: list[int], tokens: list[int]) -> None:
    import dataclasses

    import jax

    state = self.runner.state
    last = np.asarray(state.last_tokens).copy()
    last[slots] = tokens
    placed = jax.device_put(last, state.last_tokens.sharding)
    self.runner.state = dataclasses.replace(state, last_tokens=placed)

  def generate(self, prompts: list[list[int]], max_tokens: int):
    """-> (tokens per prompt, prefill logits [n, V], decode logits [steps, n, V])."""
    from serving.runner.inputs import build_prefill_input
    from serving.runner.sampling import SamplingTensors
    from serving.runner.steps import DecodeInput
    from serving.types import PrefillChunk, SamplingParams, Sequence

    ec = self.runner.engine_cfg
    ps, width, t = ec.cache.page_size, ec.block_table_width, ec.scheduler.prefill_token_buckets[-1]
    pages = [np.arange(PAGES_PER_SEQ, dtype=np.int32) + 1 + i * PAGES_PER_SEQ
             for i in range(len(prompts))]
    tables = np.zeros((len(prompts), width), np.int32)
    tables[:, :PAGES_PER_SEQ] = pages
    layout = self.runner.kv_layout
    hybrid = layout is not None
    assert not hybrid or layout.window_pages > int(np.max(pages)), "window group too small"
    first = []
    for i, prompt in enumerate(prompts):
      seq = Sequence(request_id=str(i), prompt_ids=list(prompt),
                     params=SamplingParams(temperature=0.0), pages=list(pages[i]),
                     window_pages=list(pages[i]) if hybrid else [], decode_slot=i)
      inp, _ = build_prefill_input([PrefillChunk(seq, 0, len(prompt), sample=True)], ec,
                                   bucket=t, window=hybrid)
      first.append(self._step("prefill", inp)[0])
    out = [[int(np.argmax(lg))] for lg in first]
    b = ec.scheduler.decode_batch_buckets[-1]
    decode_logits = []
    for _ in range(max_tokens - 1):
      self._set_last_tokens(list(range(len(prompts))), [o[-1] for o in out])
      pos = np.zeros(b, np.int32)
      lens = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
      pos[:len(lens)] = lens
      slots = np.full(b, ec.scheduler.max_num_seqs, np.int32)  # padding rows: the dummy slot
      slots[:len(prompts)] = np.arange(len(prompts))
      bt = np.zeros((b, width), np.int32)
      bt[:len(prompts)] = tables
      smap = np.where(np.arange(b) < len(prompts), bt[np.arange(b), pos // ps] * ps + pos % ps, 0)
      seq_lens = np.where(np.arange(b) < len(prompts), pos + 1, 0).astype(np.int32)
      inp = DecodeInput(decode_slots=slots, positions=pos, kv_index=smap.astype(np.int32),
                        block_tables=bt, seq_lens=seq_lens, lora_slots=np.full(b, -1, np.int32),
                        sampling=SamplingTensors.build([], [], [], b),
                        window_kv_index=smap.astype(np.int32) if hybrid else None,
                        window_block_tables=bt if hybrid else None)
      logits = self._step("decode", inp)[:len(prompts)]
      decode_logits.append(logits)
      for o, lg in zip(out, logits, strict=True):
        o.append(int(np.argmax(lg)))
    return out, np.stack(first), np.stack(decode_logits)


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_collectives(hlo: str) -> dict:
  """Counts of each collective in compiled HLO text, and the all-gather result shapes."""
  counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", hlo)) for c in _COLLECTIVES}
  gathers = []
  for m in re.finditer(r"=\s*(\(?[^=]*?\)?)\s+all-gather(?:-start)?\(", hlo):
    gathers += [tuple(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"\[([\d,]*)\]", m.group(1))]
  return {"counts": counts, "all_gather_shapes": sorted(set(gathers))}


def weight_shapes(params) -> set[tuple[int, ...]]:
  """Full (global) shapes of every matrix in a stacked params tree, stacked and per layer."""
  import jax

  out = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    shape = tuple(leaf.shape)
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    if len(shape) - stacked >= 2:
      out.add(shape)
      if stacked:
        out.add(shape[1:])
  return out


def emit(result: dict) -> None:
  """The worker's answer: one JSON line on stdout."""
  print(json.dumps(result), flush=True)
