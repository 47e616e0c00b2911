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
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, assert_matches_torch, run_requests, save_tiny_model

DENSE_FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2"]
PROMPT_LENS = [3, 11, 20, 37]  # 37 > max_num_batched_tokens: chunked prefill
LOGPROB_TOL = 1e-4
NEW_TOKENS = 64


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=64,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})



@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_family_matches_transformers(family, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config())
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  assert_matches_torch(model, prompts, run_requests(engine, prompts, params), NEW_TOKENS,
                       LOGPROB_TOL)
