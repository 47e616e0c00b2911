"""GPT-OSS through the engine against transformers (float32).

The tiny GPT-OSS model (tests/tiny_models.py: window 8, sliding and full
layers alternating, sinks, biases, YaRN, a clamped SwiGLU the weights reach)
serves a ragged batch of prompts up to 37 tokens (chunked: the prefill
budget is 32) concurrently; 64 greedy tokens must equal a greedy loop over
the torch model, and the first step's top-20 logprobs its log-softmax within
1e-4. Once with float experts and scanned layers, once with the experts
stored as MXFP4 (tests/mxfp4_testutil.py; transformers runs on its own
dequantization of the blocks) and unrolled layers.
"""

from __future__ import annotations

import numpy as np
import pytest
from mxfp4_testutil import save_tiny_mxfp4_model

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import assert_matches_torch, run_requests, save_tiny_model

PROMPT_LENS = [3, 11, 20, 37]  # window 8; 37 > max_num_batched_tokens: chunked prefill
NEW_TOKENS = 64
LOGPROB_TOL = 1e-4


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=72,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("experts,unroll", [("float", False), ("mxfp4", True)])
def test_matches_transformers(experts, unroll, tmp_path):
  save = save_tiny_mxfp4_model if experts == "mxfp4" else (
      lambda path: save_tiny_model("gpt_oss", path))
  model = save(str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config(unroll_layers=unroll))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  assert_matches_torch(model, prompts, run_requests(engine, prompts, params), NEW_TOKENS,
                       LOGPROB_TOL)
