"""Multi-step decoding on real (tiny) models: the same tokens as one step at a time.

- The tiny SmolLM2 quantized to int4 (the fused native decoder on CPU):
  greedy tokens and logprobs, and seeded sampling with penalties, equal the
  engine with `num_decode_steps=1`, on ragged requests more than the slots.
- A tiny Llama in float32 (the XLA path, scanned layers) against `transformers`.
- The multi-step program updates the donated KV pool in place (no copy).
Scheduling and bookkeeping (stops inside a run, prefix pages, preemption,
failures): tests/serving/engine/test_multi_step.py. Zero compilations after
warm-up with multi-step on: tests/serving/engine/test_engine.py.
"""

import jax
import numpy as np
import pytest

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import save_tiny_model, torch_greedy

K = 4
PROMPTS = [[5, 6, 7], [40 + i % 9 for i in range(13)], [100 + (i * 7) % 31 for i in range(21)]]


def config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=2, max_model_len=128, page_size=8, num_pages=40,
              max_num_batched_tokens=32, attention_block_tokens=16, dtype="float32",
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def count_multi_steps(engine) -> list[int]:
  """Wraps the runner's multi-step call; the returned list grows by one per call."""
  calls = []
  runner = engine.runner
  original = runner.run_multi_decode

  def counted(inp, later, later_window=None):
    calls.append(later.shape[1] + 1)
    return original(inp, later, later_window)

  runner.run_multi_decode = counted
  return calls


def outputs(engine, params: list[SamplingParams]) -> list:
  outs = {i: [] for i in range(len(PROMPTS))}
  for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
    engine.add_request(f"r{i}", p, sp, outs[i].append)
  engine.run_until_idle()
  assert engine.allocator.num_free == engine.allocator.num_usable
  return [(sum((o.token_ids for o in outs[i]), []),
           [lp.logprob for o in outs[i] for lp in (o.logprobs or [])])
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_smollm2"))
  save_tiny_model("smollm2", path)
  return path


@pytest.fixture(scope="module")
def int4_engines(smollm_dir):
  kw = dict(quantization="int4", unroll_layers=True)
  return (build_engine(smollm_dir, config(**kw)),
          build_engine(smollm_dir, config(num_decode_steps=K, **kw)))


def test_native_greedy_tokens_and_logprobs_match_single_steps(int4_engines):
  single, multi = int4_engines
  calls = count_multi_steps(multi)
  params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
            for n in (11, 17, 9)]  # not multiples of K: runs end with single steps
  want, got = outputs(single, params), outputs(multi, params)
  assert [t for t, _ in got] == [t for t, _ in want]
  for (_, g), (_, w) in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5)
  assert calls and set(calls) == {K}


def test_native_seeded_sampling_with_penalties_matches_single_steps(int4_engines):
  single, multi = int4_engines
  calls = count_multi_steps(multi)
  params = [SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, top_k=50, seed=7 + i,
                           repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True)
            for i in range(len(PROMPTS))]
  assert [t for t, _ in outputs(multi, params)] == [t for t, _ in outputs(single, params)]
  assert calls


def test_xla_path_matches_transformers(tmp_path):
  model = save_tiny_model("llama", str(tmp_path))
  engine = build_engine(str(tmp_path), config(num_decode_steps=K, unroll_layers=False))
  calls = count_multi_steps(engine)
  params = [SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
  got = [t for t, _ in outputs(engine, params)]
  assert got == [torch_greedy(model, p, 13)[0] for p in PROMPTS]
  assert calls


def test_the_multi_step_program_updates_the_pool_in_place(int4_engines):
  _, multi = int4_engines
  runner = multi.runner
  inp = runner.dummy_decode(1)
  later = np.zeros((1, K - 1), np.int32)
  allowed = jax.ShapeDtypeStruct((1, runner.mask_width), np.int32)
  hlo = runner._multi_decode.jitted.lower(runner.params, runner.lora, runner.state, inp,
                                          later, allowed).compile().as_text()
  pool = runner.state.kv.k
  shape = f"{pool.dtype}[" + ",".join(str(d) for d in pool.shape) + "]"
  shape = shape.replace("float32", "f32").replace("bfloat16", "bf16")
  copies = [line for line in hlo.splitlines() if " copy(" in line and shape in line]
  assert not copies, copies
