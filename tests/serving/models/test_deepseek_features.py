"""DeepSeek-V3 (latent KV cache) with the engine's model-independent features (tiny
model, float32 unless said).

- One fresh engine with the prefix cache on, a page pool small enough to
  preempt and n-gram speculation (verification reads the latent pages too),
  watched from the end of its warm-up: nothing compiles, and every greedy
  request (prompts behind a shared 24-token prefix, one chunked) equals
  transformers token for token.
- A step that fails after it ran on the device (latent rows of every sequence in it
  written) fails its own request only: the others, sharing steps with it, still
  equal transformers token for token, and every page is free afterwards.
- int8 weights (wq / wo, the MLP and the experts; the latent projections stay
  float) and int8 / bfloat16 latent caches: the first step's log-probs stay close
  to transformers'.
Elsewhere: parity, chunked prefill and the capacity line (test_deepseek_parity.py),
tp / ep (tests/sharding/test_deepseek_parallel.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from compile_watch import compile_events
from runner_faults import FaultyRunner

from serving.config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.engine_builder import build_engine
from serving.models.quantized import is_quantized
from serving.types import SamplingParams
from tiny_models import save_tiny_model, torch_greedy

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("deepseek"))
  return path, save_tiny_model("deepseek_v3", path)


def make_engine(path: str, **kw):
  base = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=72,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return build_engine(path, EngineConfig.of(**{**base, **kw}))


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
  """Every request added at once, run to the end -> each one's token ids."""
  results = {i: [] for i in range(len(requests))}
  for i, (prompt, params) in enumerate(requests):
    engine.add_request(f"r{i}", prompt, params, results[i].append)
  engine.run_until_idle()
  return [sum((o.token_ids for o in outs), []) for outs in results.values()]


@pytest.mark.slow
def test_prefix_cache_preemption_ngram_without_compiling(tiny):
  path, model = tiny
  jax.clear_caches()  # nothing jitted by earlier tests stands in for this engine's warm-up
  engine = make_engine(path, num_pages=20, enable_prefix_caching=True,
                       speculative_method="ngram", num_speculative_tokens=3,
                       prompt_lookup_min=1)
  rng = np.random.default_rng(5)
  shared = rng.integers(0, 256, 24).tolist()
  greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
  prompts = [shared + rng.integers(0, 256, n).tolist() for n in (9, 14, 3)]
  prompts.append(rng.integers(0, 256, 6).tolist() * 4)  # repeats: n-gram drafts
  with compile_events() as events:
    got = run(engine, [(p, greedy) for p in prompts])
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  for prompt, tokens in zip(prompts, got, strict=True):
    assert tokens == torch_greedy(model, prompt, NEW_TOKENS)[0]
  stats = engine.stats()
  assert stats.num_preemptions_total > 0, "pool too big: no preemption"
  assert stats.prefix_cache_hits_total >= 2 * 24
  # Drafts were verified over the latent pages (this random model rejects them: its
  # outputs do not repeat the prompt), and the tokens above stayed exact.
  assert stats.spec_decode.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("fail_at", ["execute", "fetch"])
def test_a_failed_step_fails_only_its_request(fail_at, tiny):
  path, model = tiny
  built = make_engine(path)
  doomed = 255  # the failing request's first token; the others start lower
  faulty = FaultyRunner(built.runner, fail_request=lambda s: s.prompt_ids[0] == doomed,
                        fail_at=fail_at)
  engine = LLMEngine(runner=faulty, tokenizer=built.tokenizer, config=built.config)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 200, n).tolist() for n in (12, 40, 5)]
  prompts.insert(1, [doomed, *rng.integers(0, 200, 9).tolist()])
  results = {i: [] for i in range(len(prompts))}
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
  for i, prompt in enumerate(prompts):
    engine.add_request(f"r{i}", prompt, params, results[i].append)
  engine.run_until_idle()
  assert results[1][-1].finish_reason == "error"
  for i in (0, 2, 3):
    tokens = sum((o.token_ids for o in results[i]), [])
    assert tokens == torch_greedy(model, prompts[i], NEW_TOKENS)[0], i
  assert engine.allocator.num_free == engine.allocator.num_usable


@pytest.mark.slow
@pytest.mark.parametrize("quantization,kv_dtype,tol", [
    ("int8", "int8", 0.02), (None, "bfloat16", 0.02), (None, "int8", 0.02)])
def test_quantized_weights_and_latent_cache(quantization, kv_dtype, tol, tiny):
  path, model = tiny
  engine = make_engine(path, quantization=quantization, kv_cache_dtype=kv_dtype)
  layers = engine.runner.params["layers"]
  if quantization:
    assert is_quantized(layers["wo"]) and is_quantized(layers["we_gate"])
  assert engine.runner.state.kv.dtype == kv_dtype
  prompt = np.random.default_rng(6).integers(0, 256, 20).tolist()
  results = []
  engine.add_request("q", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20),
                     results.append)
  engine.run_until_idle()
  first = results[0].logprobs[0]
  ref = torch_greedy(model, prompt, 1)[1]
  ids = [i for i, _ in first.top]
  np.testing.assert_allclose([lp for _, lp in first.top], ref[ids], atol=tol)
