"""Phi-3 with the engine's model-independent features (tiny "phi3": Phi-4-mini's
shape with a 16-token sliding window on every layer; tests/tiny_models.py).

- One engine with prefix caching, n-gram speculation, chunked prefill and a
  page pool small enough to force preemption runs a staggered workload
  (shared prefixes longer than the window, repetitive prompts, a constrained
  request): every greedy request equals `transformers`, the workload really
  preempted, hit the prefix cache and kept drafts, and nothing compiled after
  warm-up (the strict check: caches cleared first, events watched).
- int8 / int4 weights (float activations): exactly `transformers` running the
  dequantized weights the engine holds, so the fused q/k/v and gate/up rows,
  once split, are quantized and served like any Llama-layout weight.
- int8 KV cache: within the int8 rounding of `transformers`.
Tensor and pipeline parallelism: tests/sharding/test_phi3_sharded.py; LoRA:
tests/serving/models/test_lora_parity.py; draft-model speculation:
tests/serving/engine/test_spec_models.py.
"""

import copy

import jax
import numpy as np
import pytest
import torch
from compile_watch import compile_events

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.models.quantized import is_quantized
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(directory, torch model) of the tiny phi3."""
  path = str(tmp_path_factory.mktemp("phi3"))
  return path, save_tiny_model("phi3", path)


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=64,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def workload(rng) -> list[tuple[int, list[int], SamplingParams]]:
  """(arrival step, prompt, params): a 40-token prefix shared by three prompts (two
  arrive once the first has cached it), repetitive prompts for the n-gram proposer,
  prompts longer than a 32-token chunk, and one request constrained to a choice."""
  greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
  shared = rng.integers(0, VOCAB, 40).tolist()
  loop = [int(t) for t in rng.integers(0, VOCAB, 6)] * 6
  reqs = [(0, shared + rng.integers(0, VOCAB, 5).tolist(), greedy),
          (0, loop, greedy),
          (0, rng.integers(0, VOCAB, 50).tolist(), greedy),
          (1, rng.integers(0, VOCAB, 19).tolist(),
           SamplingParams(max_tokens=8, temperature=0.0,
                          structured_outputs={"choice": ["alpha", "beta", "gamma"]})),
          (12, shared + rng.integers(0, VOCAB, 9).tolist(), greedy),
          (12, shared + loop[:12], greedy),
          (13, loop[:20] + rng.integers(0, VOCAB, 30).tolist(), greedy)]
  return reqs


def drive(engine, reqs) -> dict[int, list]:
  """Adds each request at its arrival step and steps the engine until all are done."""
  outs = {i: [] for i in range(len(reqs))}
  step = 0
  while step <= max(a for a, _, _ in reqs) or engine.has_unfinished():
    for i, (arrival, prompt, params) in enumerate(reqs):
      if arrival == step:
        engine.add_request(f"r{i}", prompt, params, outs[i].append)
    engine.step()
    step += 1
    assert step < 500
  return outs


@pytest.mark.slow
def test_prefix_cache_preemption_ngram_structured_without_compiles(tiny):
  path, model = tiny
  jax.clear_caches()  # nothing jitted earlier can stand in for this engine's warm-up
  engine = build_engine(path, engine_config(
      num_pages=14, enable_prefix_caching=True, speculative_method="ngram",
      num_speculative_tokens=3, prompt_lookup_min=2))
  reqs = workload(np.random.default_rng(5))
  with compile_events() as events:
    outs = drive(engine, reqs)
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  for i, (_, prompt, params) in enumerate(reqs):
    tokens = sum((o.token_ids for o in outs[i]), [])
    if params.structured_outputs is not None:
      assert "".join(o.text for o in outs[i]) in ("alpha", "beta", "gamma")
    else:
      assert tokens == torch_greedy(model, prompt, params.max_tokens)[0], f"request {i}"
  stats = engine.stats()
  assert stats.num_preemptions_total > 0, "pool too big: no preemption"
  assert stats.prefix_cache_hits_total > 0, "no prefix-cache hit"
  assert stats.spec_decode.num_accepted_tokens > 0, "no n-gram draft kept"
  assert engine.allocator.num_free == engine.allocator.num_usable


def dequantized_torch(model, params):
  """A copy of the torch model holding the engine's (dequantized) weights, in the
  checkpoint's fused layout: the reference for a quantized engine."""
  def rows(w):  # a params leaf -> [..., Out, In] float32
    return np.asarray(w.dequantize()) if is_quantized(w) else np.swapaxes(np.asarray(w), -1, -2)

  ref = copy.deepcopy(model)
  lp = params["layers"]
  wq, wk, wv, wo = (rows(lp[k]) for k in ("wq", "wk", "wv", "wo"))
  gate, up, down = (rows(lp[k]) for k in ("w_gate", "w_up", "w_down"))
  with torch.no_grad():
    for i, layer in enumerate(ref.model.layers):
      layer.self_attn.qkv_proj.weight.copy_(torch.tensor(
          np.concatenate([wq[i], wk[i], wv[i]])))
      layer.self_attn.o_proj.weight.copy_(torch.tensor(wo[i]))
      layer.mlp.gate_up_proj.weight.copy_(torch.tensor(np.concatenate([gate[i], up[i]])))
      layer.mlp.down_proj.weight.copy_(torch.tensor(down[i]))
    embed = params["embed"]  # tied: the head's storage [V, D]
    ref.model.embed_tokens.weight.copy_(torch.tensor(
        np.asarray(embed.dequantize()) if is_quantized(embed) else np.asarray(embed)))
  return ref


def run(engine, prompts, n):
  params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=10)
  outs = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, outs[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in v), []), v[0].logprobs[0]) for v in outs.values()]


def first_step_error(first, ref_lp) -> float:
  return float(np.max(np.abs([lp - ref_lp[t] for t, lp in first.top])))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_equal_transformers_on_their_values(tiny, method):
  path, model = tiny
  engine = build_engine(path, engine_config(quantization=method, cpu_activation_bits=32))
  params = engine.runner.params
  assert is_quantized(params["layers"]["wq"]) and is_quantized(params["layers"]["w_up"])
  ref = dequantized_torch(model, params)
  prompts = [np.random.default_rng(2).integers(0, VOCAB, n).tolist() for n in (21, 40)]
  for prompt, (tokens, first) in zip(prompts, run(engine, prompts, 32), strict=True):
    ref_tokens, ref_lp = torch_greedy(ref, prompt, 32)
    assert tokens == ref_tokens
    assert first_step_error(first, ref_lp) < LOGPROB_TOL


@pytest.mark.slow
def test_int8_kv_cache_stays_near_transformers(tiny):
  path, model = tiny
  engine = build_engine(path, engine_config(kv_cache_dtype="int8"))
  assert engine.runner.state.kv.dtype == "int8"
  prompts = [np.random.default_rng(3).integers(0, VOCAB, n).tolist() for n in (21, 40)]
  for prompt, (_, first) in zip(prompts, run(engine, prompts, 1), strict=True):
    _, ref_lp = torch_greedy(model, prompt, 1)
    assert 0 < first_step_error(first, ref_lp) < 1e-2
