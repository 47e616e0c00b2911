"""Parity of the engine against Hugging Face `transformers` (float32).

For a tiny random-weight model of each dense family, a ragged batch of
prompts runs concurrently through the real engine (paged KV cache, chunked
prefill, continuous batching): the first step's top-20 logprobs must equal
`transformers`' log-softmax at the final prompt position within 1e-4, and
64 greedy tokens must be identical to a greedy loop over the torch model.
MoE families are covered in tests/sharding.
"""

import numpy as np
import pytest

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

DENSE_FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2"]
PROMPT_LENS = [3, 11, 20, 37]  # 37 > max_num_batched_tokens: chunked prefill
LOGPROB_TOL = 1e-4
NEW_TOKENS = 64


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=64,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})



def run_engine(engine: LLMEngine, prompts, params: SamplingParams):
  results = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, results[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in outs), []), sum((o.logprobs or [] for o in outs), []),
           outs[-1].finish_reason) for outs in results.values()]


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_family_matches_transformers(family, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config())
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  outs = run_engine(engine, prompts, params)
  for prompt, (tokens, logprobs, reason) in zip(prompts, outs, strict=True):
    ref_tokens, ref_lp = torch_greedy(model, prompt, NEW_TOKENS)
    assert reason == "length"
    assert tokens == ref_tokens
    first = logprobs[0]
    top_ids = [i for i, _ in first.top]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[top_ids], atol=LOGPROB_TOL)
    assert top_ids[0] == int(np.argmax(ref_lp))
    assert abs(first.logprob - ref_lp[tokens[0]]) < LOGPROB_TOL
