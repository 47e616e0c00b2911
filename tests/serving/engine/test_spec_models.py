"""Speculative decoding on real models: greedy output is unchanged, token for token.

- The default model (float32 weights) with each method, a ragged batch against
  the same engine options without speculation (the session's `default_llm`);
  the draft method drafts with the default model itself, so nearly every draft
  is kept and the draft model's K/V bookkeeping is exercised end to end.
- A tiny random model of every family with a draft model that is another tiny
  model of the family (other weights: drafts are mostly rejected), against
  `transformers` (dense) or the engine without speculation (MoE).
- The tiny llama with each method and with itself as the draft (all kept).
Zero compilations after warm-up with speculation on: tests/serving/engine/test_engine.py.
"""

import numpy as np
import pytest
from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG

from serving import LLM, SamplingParams
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from tiny_models import SWEEP_FAMILIES, save_tiny_model, torch_greedy

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
RAW = ["The capital of France is", "One, two, three, four,", "def fibonacci(n):\n"]
MOE = ("mixtral", "qwen3_moe")


def default_prompts(tok) -> list[list[int]]:
  chat = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
  return ([tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))]
          + [tok.encode(t, add_special_tokens=True) for t in RAW])


@pytest.fixture(scope="module")
def spec_llm():
  """method -> the default model's LLM speculating with it (built once per module)."""
  cache = {}

  def get(method):
    if method not in cache:
      kw = dict(speculative_method=method)
      if method == "draft":
        kw["speculative_model"] = DEFAULT_MODEL
      cache[method] = LLM(DEFAULT_MODEL, **DEFAULT_MODEL_TEST_CONFIG, **kw)
    return cache[method]

  return get


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_default_model_greedy_output_is_unchanged(default_llm, spec_llm, method):
  llm = spec_llm(method)
  prompts = default_prompts(llm.get_tokenizer())
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
  want = default_llm.generate(prompts, params)
  got = llm.generate(prompts, params)
  assert [o.token_ids for o in got] == [o.token_ids for o in want]
  for g, w in zip(got, want, strict=True):  # logprobs of kept drafts: the verify forward's
    np.testing.assert_allclose([lp.logprob for lp in g.logprobs],
                               [lp.logprob for lp in w.logprobs], atol=2e-3)
    assert [[t for t, _ in lp.top] for lp in g.logprobs] == [
        [t for t, _ in lp.top] for lp in w.logprobs]
  spec = llm.engine.stats().spec_decode
  assert spec.num_accepted_tokens > 0, spec
  if method == "draft":  # the model drafting for itself: (nearly) every draft kept
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, spec
  alloc = llm.engine.allocator
  assert alloc.num_free == alloc.num_usable


@pytest.mark.slow
def test_default_model_constrained_requests_speculate(default_llm, spec_llm):
  """JSON that copies the prompt: n-gram drafts the grammar allows are verified with a
  mask per position; the output equals the plain engine's."""
  llm = spec_llm("ngram")
  tok = llm.get_tokenizer()
  record = ('{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", '
            '"notes": "first program"}')
  chat = [{"role": "user", "content": f"Repeat this JSON exactly: {record}"}]
  prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
  params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"json_object": True})
  before = llm.engine.stats().spec_decode.num_accepted_tokens
  got = llm.generate([prompt], params)[0]
  assert got.token_ids == default_llm.generate([prompt], params)[0].token_ids
  assert llm.engine.stats().spec_decode.num_accepted_tokens > before
  assert got.text.startswith("{")


def tiny_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=40,
              max_num_batched_tokens=16, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False, num_speculative_tokens=4)
  return EngineConfig.of(**{**base, **kw})


# Ragged, and more than max_num_seqs: one waits, then joins a running batch.
PROMPTS = [[5, 6, 7], [40 + i % 9 for i in range(13)], [100 + (i * 7) % 31 for i in range(21)]]
N_TOKENS = 20


def greedy_outputs(engine) -> list[list[int]]:
  outs = {i: [] for i in range(len(PROMPTS))}
  params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
  for i, p in enumerate(PROMPTS):
    engine.add_request(f"r{i}", p, params, outs[i].append)
  engine.run_until_idle()
  assert engine.allocator.num_free == engine.allocator.num_usable
  return [sum((o.token_ids for o in outs[i]), []) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
  """family -> (target directory, its torch model, draft directory: other weights)."""
  cache = {}

  def get(family):
    if family not in cache:
      target, draft = (str(tmp_path_factory.mktemp(f"{family}_{n}")) for n in ("t", "d"))
      model = save_tiny_model(family, target, seed=0)
      save_tiny_model(family, draft, seed=1)
      cache[family] = (target, model, draft)
    return cache[family]

  return get


@pytest.mark.slow
@pytest.mark.parametrize("family", SWEEP_FAMILIES)
def test_every_family_with_a_draft_model(family, family_dirs, request):
  target, model, draft = family_dirs(family)
  engine = build_engine(target, tiny_config(speculative_method="draft", speculative_model=draft))
  got = greedy_outputs(engine)
  if family in MOE:  # the engine's MoE parity with torch is checked in tests/sharding
    want = greedy_outputs(build_engine(target, tiny_config()))
  else:
    want = [torch_greedy(model, p, N_TOKENS)[0] for p in PROMPTS]
  assert got == want
  assert engine.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "self-draft"])
def test_tiny_llama_with_each_method(method, family_dirs):
  target, model, _ = family_dirs("llama")
  kw = (dict(speculative_method="draft", speculative_model=target) if method == "self-draft"
        else dict(speculative_method=method, prompt_lookup_min=1))
  engine = build_engine(target, tiny_config(**kw))
  assert greedy_outputs(engine) == [torch_greedy(model, p, N_TOKENS)[0] for p in PROMPTS]
  spec = engine.stats().spec_decode
  if method == "self-draft":
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
