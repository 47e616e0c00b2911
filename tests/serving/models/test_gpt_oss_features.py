"""GPT-OSS with the engine's model-independent features (tiny model, float32 unless said).

- One fresh engine with the prefix cache on, a page pool small enough to
  preempt, n-gram speculation and a constrained request, watched from the end
  of its warm-up: nothing compiles, and every greedy request (prompts past the
  window behind a shared 24-token prefix) equals transformers token for token.
- int8 / int4 weights and an int8 KV cache: the weights are quantized (the
  MXFP4 experts of a MXFP4 checkpoint stay as stored) and the first step's
  log-probs stay close to transformers'.
Elsewhere: parity and chunked prefill (test_gpt_oss_parity.py), tp / ep / pp
(tests/sharding/test_gpt_oss_parallel.py), LoRA (test_lora_parity.py), a
draft model (tests/serving/engine/test_spec_models.py).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from compile_watch import compile_events
from mxfp4_testutil import save_tiny_mxfp4_model

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.models.quantized import is_quantized
from serving.types import SamplingParams
from tiny_models import save_tiny_model, torch_greedy

NEW_TOKENS = 24
REGEX = "[a-z]+( [a-z]+)*"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gpt_oss"))
  return path, save_tiny_model("gpt_oss", path)


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
def test_prefix_cache_preemption_ngram_structured_without_compiling(tiny):
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
  constrained = SamplingParams(max_tokens=8, temperature=0.0,
                               structured_outputs={"regex": REGEX})
  with compile_events() as events:
    got = run(engine, [(p, greedy) for p in prompts] + [(shared[:10], constrained)])
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  for prompt, tokens in zip(prompts, got, strict=False):
    assert tokens == torch_greedy(model, prompt, NEW_TOKENS)[0]
  assert re.fullmatch(REGEX, engine.tokenizer.decode(got[-1]))
  stats = engine.stats()
  assert stats.num_preemptions_total > 0, "pool too big: no preemption"
  assert stats.prefix_cache_hits_total >= 2 * 24
  assert stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("experts,quantization,tol", [
    ("float", "int8", 0.02), ("float", "int4", 0.3), ("mxfp4", "int8", 0.02)])
def test_quantized_weights_and_kv(experts, quantization, tol, tmp_path):
  model = (save_tiny_mxfp4_model(str(tmp_path)) if experts == "mxfp4"
           else save_tiny_model("gpt_oss", str(tmp_path)))
  engine = make_engine(str(tmp_path), quantization=quantization, kv_cache_dtype="int8")
  layers = engine.runner.params["layers"]
  assert is_quantized(layers["wq"]) and layers["wq"].kind == quantization
  assert layers["we_gate"].kind == ("mxfp4" if experts == "mxfp4" else quantization)
  prompt = np.random.default_rng(6).integers(0, 256, 20).tolist()
  results = []
  engine.add_request("q", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20),
                     results.append)
  engine.run_until_idle()
  first = results[0].logprobs[0]
  ref = torch_greedy(model, prompt, 1)[1]
  ids = [i for i, _ in first.top]
  np.testing.assert_allclose([lp for _, lp in first.top], ref[ids], atol=tol)
