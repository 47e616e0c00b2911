"""Gemma 2 and Gemma 3 (text) against `transformers` in float32, through the real engine.

A ragged batch of prompts, all but one longer than the 8-token window, runs
concurrently (paged KV cache of 4-token pages, chunked prefill: 37 tokens
over 32-token steps, continuous batching): 64 greedy tokens per request must
equal a greedy loop over the torch model, and the first step's top-20
logprobs its log-softmax within 1e-4. Gemma 3's tiny model has 5 sliding
layers then a full one (local / global RoPE bases, linear scaling on the
global one, q/k norms); Gemma 2's alternates, with attention and final
soft-capping. `test_the_tiny_configs_exercise_each_feature` shows that
dropping any of those features changes the reference, so the parity test
would catch a model that ignored it.
"""

import numpy as np
import pytest
import torch
import transformers

from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, assert_matches_torch, run_requests, save_tiny_model

FAMILIES = ["gemma2", "gemma3"]
PROMPT_LENS = [3, 11, 20, 37]  # window 8; 37 > max_num_batched_tokens: chunked prefill
NUM_TOKENS = 64
LOGPROB_TOL = 1e-4



def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=112, page_size=4, num_pages=128,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def prompts() -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_matches_transformers(family, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  engine = build_engine(str(tmp_path), engine_config())
  params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
  batch = prompts()
  assert_matches_torch(model, batch, run_requests(engine, batch, params), NUM_TOKENS,
                       LOGPROB_TOL)


def _variant(model, **changes) -> transformers.PreTrainedModel:
  """`model` with config `changes`, same weights."""
  config = type(model.config)(**{**model.config.to_dict(), **changes})
  other = transformers.AutoModelForCausalLM.from_config(config).eval()
  other.load_state_dict(model.state_dict())
  return other


def _next_logprobs(model, prompt) -> np.ndarray:
  with torch.no_grad():
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()


@pytest.mark.parametrize("family,changes", [
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(layer_types=["full_attention"] * 4)),
    ("gemma3", dict(layer_types=["full_attention"] * 6)),
    ("gemma3", dict(rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 1e6},
                                     "full_attention": {"rope_type": "default",
                                                        "rope_theta": 1e6}})),
    ("gemma3", dict(query_pre_attn_scalar=16)),
])
def test_the_tiny_configs_exercise_each_feature(family, changes, tmp_path):
  model = save_tiny_model(family, str(tmp_path))
  prompt = prompts()[-1]
  base = _next_logprobs(model, prompt)
  other = _next_logprobs(_variant(model, **changes), prompt)
  assert np.abs(base - other).max() > 100 * LOGPROB_TOL
