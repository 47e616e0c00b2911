"""The model-independent features on tiny Gemma 3 (5 sliding layers of 8 tokens, 1 full).

Each engine runs prompts longer than the window and compares with
`transformers` (float32, greedy) where the feature leaves the tokens alone:
prefix caching + preemption + chunked prefill in one workload, n-gram
speculation; structured output must follow its grammar; int8 / int4 weights
and an int8 KV cache must stay close to the reference's first-step
log-probs; and a fresh engine compiles nothing after its warm-up under a
workload with all of these. LoRA: tests/serving/models/test_lora_parity.py
(every tiny family); tp / pp: tests/sharding/test_gemma_parallel.py; the
chat template and EOS ids: tests/checkpoints/test_gemma_tokenizer.py.
"""

import re

import jax
import numpy as np
import pytest
from compile_watch import compile_events

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

FAMILY = "gemma3"
GREEDY = dict(temperature=0.0, ignore_eos=True)



@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
  path = str(tmp_path_factory.mktemp(FAMILY))
  return path, save_tiny_model(FAMILY, path)


def make_engine(path: str, **kw):
  base = dict(max_num_seqs=4, max_model_len=96, page_size=4, num_pages=64,
              max_num_batched_tokens=16, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return build_engine(path, EngineConfig.of(**{**base, **kw}))


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
  """All requests at once -> each one's tokens."""
  results = {i: [] for i in range(len(requests))}
  for i, (prompt, params) in enumerate(requests):
    engine.add_request(f"g{i}", prompt, params, results[i].append)
  engine.run_until_idle()
  return [sum((o.token_ids for o in outs), []) for outs in results.values()]


def workload(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
  """`n` greedy requests, half behind a shared 20-token prefix, 9..40-token prompts."""
  rng = np.random.default_rng(seed)
  shared = rng.integers(0, VOCAB, 20).tolist()
  reqs = []
  for i in range(n):
    prompt = rng.integers(0, VOCAB, int(rng.integers(9, 21))).tolist()
    prompt = shared + prompt if i % 2 else prompt
    reqs.append((prompt, SamplingParams(max_tokens=int(rng.integers(6, 16)), **GREEDY)))
  return reqs


@pytest.mark.slow
def test_prefix_cache_preemption_and_chunked_prefill_keep_greedy_tokens(gemma):
  path, model = gemma
  engine = make_engine(path, num_pages=28, enable_prefix_caching=True)
  reqs = workload(0, 8)
  got = run(engine, reqs)
  assert got == [torch_greedy(model, p, s.max_tokens)[0] for p, s in reqs]
  stats = engine.stats()
  assert stats.num_preemptions_total > 0, "pool too big: no preemption"
  assert stats.prefix_cache_hits_total > 0, "no prefix-cache hit"


@pytest.mark.slow
def test_a_long_sequence_holds_its_full_pages_and_only_its_window(gemma):
  """16x the window: after every step the sequence holds the full layers' pages for its
  length and at most the window's pages + 1 in the sliding group (the rest released),
  and its tokens still equal transformers'."""
  path, model = gemma
  engine = make_engine(path, max_model_len=160, num_pages=48)
  window = engine.window
  assert window is not None and window.window == model.config.sliding_window
  ps = engine.config.cache.page_size
  window_pages = -(-window.window // ps)
  n = 16 * window.window
  prompt = np.random.default_rng(7).integers(0, VOCAB, 10).tolist()
  outs = []
  engine.add_request("long", prompt, SamplingParams(max_tokens=n - len(prompt), **GREEDY),
                     outs.append)
  most = 0
  while engine.has_unfinished():
    engine.step()
    seq = next((s for s in engine.scheduler.running if s.request_id == "long"), None)
    if seq is None:
      continue
    full = engine.allocator.num_usable - engine.allocator.num_free
    held = window.allocator.num_usable - window.allocator.num_free
    assert full == len(seq.pages) == -(-seq.num_computed // ps)  # positions written
    assert held == window.held(seq.window_pages) <= window_pages + 1, seq.window_pages
    most = max(most, held)
  assert most == window_pages + 1  # not vacuous: the window was full
  for alloc in (engine.allocator, window.allocator):  # finished: everything released
    assert alloc.num_free == alloc.num_usable
  tokens = sum((o.token_ids for o in outs), [])
  assert tokens == torch_greedy(model, prompt, n - len(prompt))[0]


@pytest.mark.slow
def test_ngram_speculation_keeps_greedy_tokens(gemma):
  path, model = gemma
  engine = make_engine(path, speculative_method="ngram", num_speculative_tokens=3,
                       prompt_lookup_min=1)
  rng = np.random.default_rng(5)
  reqs = [((rng.integers(0, VOCAB, 6).tolist() * 4)[:n], SamplingParams(max_tokens=16, **GREEDY))
          for n in (12, 22)]
  assert run(engine, reqs) == [torch_greedy(model, p, 16)[0] for p, _ in reqs]
  assert engine.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.slow
def test_structured_output_follows_its_grammar(gemma):
  path, _ = gemma
  engine = make_engine(path)
  tok = engine.tokenizer
  regex = "(ab|cd)+x"
  params = SamplingParams(max_tokens=12, temperature=0.9, seed=1,
                          structured_outputs={"regex": regex})
  prompts = [tok.encode("x" * n) for n in (12, 30)]
  for tokens in run(engine, [(p, params) for p in prompts]):
    assert re.fullmatch(regex, tok.decode(tokens)), tok.decode(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("quant,kv,tol", [(None, "int8", 0.02), ("int8", "auto", 0.05),
                                          ("int4", "int8", 0.3)])
def test_quantized_weights_and_kv_stay_close(gemma, quant, kv, tol):
  path, model = gemma
  engine = make_engine(path, quantization=quant, kv_cache_dtype=kv)
  prompt = np.random.default_rng(2).integers(0, VOCAB, 30).tolist()
  params = SamplingParams(max_tokens=4, logprobs=20, **GREEDY)
  outs = []
  engine.add_request("q", prompt, params, outs.append)
  engine.run_until_idle()
  first = sum((o.logprobs or [] for o in outs), [])[0]
  _, ref = torch_greedy(model, prompt, 1)
  ids = [i for i, _ in first.top]
  np.testing.assert_allclose([lp for _, lp in first.top], ref[ids], atol=tol)


@pytest.mark.slow
def test_no_compilation_after_warm_up(gemma):
  """A fresh engine (prefix cache, n-gram speculation, a pool small enough to preempt),
  watched from the end of its warm-up, under greedy, sampled and constrained requests."""
  path, _ = gemma
  jax.clear_caches()
  engine = make_engine(path, num_pages=24, enable_prefix_caching=True,
                       speculative_method="ngram", num_speculative_tokens=3,
                       prompt_lookup_min=1)
  reqs = workload(0, 8)
  reqs[1] = (reqs[1][0], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3))
  reqs[2] = (reqs[2][0], SamplingParams(max_tokens=6, temperature=0.0,
                                        structured_outputs={"regex": "[a-z]+"}))
  with compile_events() as events:
    run(engine, reqs)
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  stats = engine.stats()
  assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
