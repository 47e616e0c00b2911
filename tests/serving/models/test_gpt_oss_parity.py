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
from tiny_models import save_tiny_model, torch_greedy

PROMPT_LENS = [3, 11, 20, 37]  # window 8; 37 > max_num_batched_tokens: chunked prefill
NEW_TOKENS = 64
LOGPROB_TOL = 1e-4


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=128, page_size=8, num_pages=72,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def run_engine(engine, prompts, params):
  """Every prompt added at once, run to the end -> [(token ids, logprobs, finish reason)]."""
  results = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, results[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in outs), []), sum((o.logprobs or [] for o in outs), []),
           outs[-1].finish_reason) for outs in results.values()]


def check_matches(model, prompts, outs) -> None:
  """Greedy tokens identical to transformers; first-step top logprobs within tolerance."""
  for prompt, (tokens, logprobs, reason) in zip(prompts, outs, strict=True):
    ref_tokens, ref_lp = torch_greedy(model, prompt, NEW_TOKENS)
    assert reason == "length"
    assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
    first = logprobs[0]
    top_ids = [i for i, _ in first.top]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[top_ids], atol=LOGPROB_TOL)
    assert top_ids[0] == int(np.argmax(ref_lp))


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
  check_matches(model, prompts, run_engine(engine, prompts, params))
